"""The server side of FedFew: the three stages as one workflow, over any transport.

:class:`FedFewServer` plans and runs the stages; it talks to the sites only through a
``send(task, {site: (params, meta)}) -> {site: (params, meta)}`` callable that returns the
answers of the sites that succeeded. The NVFlare controller (:mod:`cxrfl.fl.fedfew`) passes one
built on ``send_model``; the benchmark passes one that calls :func:`cxrfl.fedfew.protocol.handle_task`
in-process. So the job and the benchmark run the same workflow.

0. ``fedfew_info``: every site's class names and label counts. CCs and UCs are told apart
   (:func:`split_classes`); sites without labelled images take part in stage 1 only.
1. Federated SimSiam: FedAvg (weighted by images) of encoder, projector and predictor.
2. Energy-based multi-label training over the CCs + "no CC": FedAvg weighted by labelled
   images. Unless both margins are configured, warm-up rounds without the energy term come
   first (CC sites only: the UC sites have no other loss) and the margins are chosen from the
   warm-up model's mean energies (:func:`cxrfl.fedfew.energy.margins_from_means`).
3. Energy threshold from the sites' error counts on a common grid (two passes: the sites' energy
   ranges make the grid, then each site counts its errors per candidate; examples: see
   :data:`cxrfl.fedfew.config.THRESHOLD_EXAMPLES`); dual prototypes from the UC sites (each
   refused at the site below the minimum number of images).

Written under ``out_dir`` (the server's app folder in a job):

- ``fedfew/stage1_ssl.pt``: the SimSiam weights after stage 1;
- ``fedfew/stage2_model.pt``: the stage-2 network (a cxrfl checkpoint) with its margins;
- ``fedfew/stage3.json``: threshold, its statistics, prototypes, refusals;
- ``FL_global_model.pt``: the final self-describing model (:mod:`cxrfl.fedfew.model`);
- ``cxrfl/rounds.jsonl``: one record per round of each stage; ``cxrfl/plan.json``: the classes
  and roles; ``cxrfl/evaluation.json``: the final model on every site's test split;
  ``cxrfl/run_config.json``: the settings.

Resuming: a stage whose result file exists is not run again. With ``resume`` set to the
``fedfew/`` folder of an earlier run (or to the app folder holding it), the latest finished
stage there is loaded (and copied into this run's folder) and the workflow goes on from the
next stage; stage 3 also needs stage 2's file. The model settings and the CC classes must
match, otherwise the run stops and says why.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import cxrfl
from cxrfl.common.io import append_record, atomic_write, json_default, to_numpy
from cxrfl.surgical.aggregation import surgical_aggregate, validate_update
from cxrfl.errors import CxrflError, UpdateRejected
from cxrfl.fedfew import protocol as P
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.energy import choose_threshold, margins_from_means, threshold_grid
from cxrfl.fedfew.learner import ssl_model, stage2_classes
from cxrfl.fedfew.model import fedfew_extra
from cxrfl.fedfew.prototypes import DualPrototype
from cxrfl.fedfew.ssl import ENCODER_PREFIX
from cxrfl.surgical.head_modes import PLACEHOLDER_CLASS, aggregate, with_placeholder_head
from cxrfl.nn.models import ModelConfig, build_model, load_checkpoint, save_checkpoint

STAGE_DIR = "fedfew"
STAGE_FILES = {1: "stage1_ssl.pt", 2: "stage2_model.pt", 3: "stage3.json"}
GLOBAL_MODEL = "FL_global_model.pt"
STAGE1_FORMAT = "cxrfl-fedfew-stage1-v1"

Message = P.Message
Send = Callable[[str, dict[str, Message]], dict[str, Message]]


class FedFewStop(CxrflError):
    """The workflow cannot go on; the message says why."""


class FedFewAborted(Exception):
    """The run was aborted from outside (NVFlare abort signal)."""


@dataclass
class ClassPlan:
    """Which classes are CCs and UCs, and who holds them.

    Args:
        cc_classes: the CCs, sorted (the network's output order, then "no CC").
        uc_classes: the UCs, sorted.
        uc_sites: UC -> the sites that label it.
        site_ucs: site -> the UCs it labels.
        stage2_sites: sites with labelled training images (stages 2 and 3).
        cc_sites: sites that label at least one CC (the only ones with a loss in warm-up rounds).
        ssl_sites: sites with images for stage 1.
        notes: messages about sites and classes left out, and why.
    """

    cc_classes: list[str]
    uc_classes: list[str]
    uc_sites: dict[str, list[str]]
    site_ucs: dict[str, list[str]]
    stage2_sites: list[str]
    cc_sites: list[str]
    ssl_sites: list[str]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"cc_classes": self.cc_classes, "uc_classes": self.uc_classes, "uc_sites": self.uc_sites,
                "site_ucs": self.site_ucs, "stage2_sites": self.stage2_sites, "cc_sites": self.cc_sites, "ssl_sites": self.ssl_sites, "notes": self.notes}


def split_classes(infos: Mapping[str, Mapping[str, Any]], config: FedFewConfig) -> ClassPlan:
    """Tell CCs from UCs using the sites' class names and training label counts.

    With ``config.uc_classes`` the UCs are those; otherwise a class is a UC when it is labelled
    at fewer than ``cc_min_sites`` sites and has fewer than ``uc_max_positives`` positive
    training images over the federation (few labels AND few clients, the paper's definition).
    Every other labelled class is a CC.

    Args:
        infos: site -> its ``info`` answer (:meth:`cxrfl.fedfew.learner.FedFewSite.info`).
        config: the settings.
    """
    notes: list[str] = []
    ssl_sites = sorted(s for s, i in infos.items() if int(i.get("n_ssl", 0)) >= 2)
    for s in sorted(set(infos) - set(ssl_sites)):
        notes.append(f"site {s} has fewer than 2 images for self-supervised training; it sits out stage 1")
    labelled = sorted(s for s, i in infos.items() if int(i.get("n_labelled", 0)) > 0)
    for s in sorted(set(infos) - set(labelled)):
        notes.append(f"site {s} has no labelled training image: it takes part in stage 1 only (no classifier "
                     "training, no threshold statistics, no prototypes)")
    sites_of: dict[str, list[str]] = {}
    positives: dict[str, int] = {}
    for s in labelled:
        for c in infos[s].get("classes", []):
            known = int(infos[s].get("positives", {}).get(c, 0)) + int(infos[s].get("negatives", {}).get(c, 0))
            if known == 0:
                continue
            sites_of.setdefault(c, []).append(s)
            positives[c] = positives.get(c, 0) + int(infos[s].get("positives", {}).get(c, 0))
    if config.uc_classes is not None:
        ucs = sorted(c for c in config.uc_classes if c in sites_of)
        for c in sorted(set(config.uc_classes) - set(sites_of)):
            notes.append(f"UC {c!r} (fedfew.uc_classes) is labelled at no site; it is left out")
    else:
        ucs = sorted(c for c in sites_of if len(sites_of[c]) < config.cc_min_sites and positives[c] < config.uc_max_positives)
    ccs = sorted(c for c in sites_of if c not in ucs)
    site_ucs = {s: [c for c in ucs if s in sites_of[c]] for s in labelled}
    for c in ucs:
        for s in sites_of[c]:
            n_pos = int(infos[s]["positives"].get(c, 0))
            n_neg = int(infos[s]["negatives"].get(c, 0))
            if min(n_pos, n_neg) < config.min_prototype_images:
                notes.append(
                    f"site {s} labels UC {c!r} with {n_pos} positive and {n_neg} negative training image(s), fewer than "
                    f"fedfew.min_prototype_images={config.min_prototype_images}: it will refuse to send that prototype"
                )
    cc_sites = sorted({s for c in ccs for s in sites_of[c]})
    return ClassPlan(ccs, ucs, {c: sorted(sites_of[c]) for c in ucs}, site_ucs, labelled, cc_sites, ssl_sites, notes)


@dataclass
class FedFewOutcome:
    """What a finished run produced (also in the files under ``out_dir``)."""

    plan: ClassPlan
    ssl_state: dict[str, np.ndarray] | None
    model_state: dict[str, np.ndarray]
    margins: dict[str, Any]
    threshold: float
    threshold_stats: dict[str, Any]
    prototypes: dict[str, list[DualPrototype]]
    refused: dict[str, str]
    evaluation: dict[str, Any] | None
    final_path: Path
    skipped_stages: list[int]


class FedFewServer:
    """The FedFew workflow.

    Args:
        send: the transport (see the module docstring).
        sites: the sites to use.
        config: FedFew settings.
        model_config: network settings (``pretrained`` is read here, for the initial encoder).
        out_dir: where results are written.
        min_clients: fewest valid results that make a round; fewer keep the previous weights.
        resume: folder of an earlier run's stage results (see the module docstring).
        evaluate_test: evaluate the final model on every site's test split.
        info: logger of progress lines.
        warning: logger of problems that do not stop the run.
        aborted: returns True when the run must stop.
    """

    def __init__(self, send: Send, *, sites: Sequence[str], config: FedFewConfig, model_config: ModelConfig,
                 out_dir: str | Path, min_clients: int = 1, resume: str | Path | None = None, evaluate_test: bool = True,
                 info: Callable[[str], None] = print, warning: Callable[[str], None] = print,
                 aborted: Callable[[], bool] = lambda: False) -> None:
        if min_clients < 1:
            raise ValueError("min_clients must be >= 1")
        self.send = send
        self.sites = list(sites)
        self.config = config
        self.model_config = model_config
        self.out = Path(out_dir)
        self.min_clients = min_clients
        self.resume = resume
        self.evaluate_test = evaluate_test
        self.info = info
        self.warning = warning
        self.aborted = aborted
        self._site_config = ModelConfig.from_dict({**model_config.to_dict(), "pretrained": None})

    # -------------------------------------------------------------- helpers
    def _path(self, *parts: str) -> Path:
        path = self.out.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _record(self, record: dict[str, Any]) -> None:
        append_record(self._path("cxrfl", "rounds.jsonl"), record)

    def _meta(self, **extra: Any) -> dict[str, Any]:
        return {"fedfew_config": self.config.to_dict(), "model_config": self._site_config.to_dict(), **extra}

    def _roles(self, plan: ClassPlan, site: str) -> dict[str, Any]:
        return {"cc_classes": plan.cc_classes, "uc_classes": plan.site_ucs.get(site, [])}

    def _check_abort(self) -> None:
        if self.aborted():
            raise FedFewAborted()

    def _broadcast(self, task: str, sites: Sequence[str], params: Mapping[str, Any],
                   meta_for: Callable[[str], dict[str, Any]]) -> dict[str, Message]:
        self._check_abort()
        payloads = {s: (dict(params), meta_for(s)) for s in sites}
        results = self.send(task, payloads)
        for s in sites:
            if s not in results:
                self.warning(f"{task}: site {s} gave no result (failed, timed out or refused; see its log); going on without it")
        return {s: r for s, r in results.items() if s in payloads}

    def _fedavg(self, results: dict[str, Message], expected: Mapping[str, tuple], classes: list[str] | None
                ) -> tuple[dict[str, np.ndarray] | None, dict[str, str], list[str]]:
        """Weighted FedAvg of the valid results (``classes``: a stage-2 head; None: no head)."""
        updates, rejected = [], {}
        shapes = dict(expected)
        if classes is None:
            shapes.update({"classifier.weight": (1, 1), "classifier.bias": (1,)})
        for site, (params, meta) in sorted(results.items()):
            n = meta.get("num_samples")
            update = {"site": site, "classes": list(classes or [PLACEHOLDER_CLASS]),
                      "params": dict(params) if classes else with_placeholder_head(params), "num_samples": n}
            try:
                validate_update(update, expected_shapes=shapes)
            except UpdateRejected as exc:
                rejected[site] = str(exc)
                self.warning(f"rejected the update of site {site}: {exc}")
                continue
            if classes is None:
                update["params"] = dict(params)
            updates.append(update)
        if len(updates) < self.min_clients:
            return None, rejected, [u["site"] for u in updates]
        if classes is None:
            params, _ = aggregate(updates, head_mode="local", weighting="samples")
        else:
            params, _ = surgical_aggregate(updates, weighting="samples", classes=classes)
        return {k: np.asarray(v) for k, v in params.items()}, rejected, [u["site"] for u in updates]

    # --------------------------------------------------------------- resume
    def _resume_dir(self) -> Path | None:
        if self.resume is None:
            own = self.out / STAGE_DIR
            return own if own.is_dir() else None
        path = Path(self.resume).expanduser()
        if not path.is_absolute():
            path = (self.out / path).resolve()
        if (path / STAGE_DIR).is_dir():
            path = path / STAGE_DIR
        if not path.is_dir():
            raise FedFewStop(f"resume folder {path} does not exist (point 'resume' at the fedfew/ folder of an earlier run)")
        return path

    def _load_resume(self, plan: ClassPlan) -> tuple[int, dict[str, Any]]:
        """The latest finished stage found and its data (0 and {} when none)."""
        src = self._resume_dir()
        if src is None:
            return 0, {}
        have = {k for k, name in STAGE_FILES.items() if (src / name).is_file()}
        done = 3 if {2, 3} <= have else 2 if 2 in have else 1 if 1 in have else 0
        if 3 in have and done < 3:
            self.warning(f"resume: {src / STAGE_FILES[3]} is there but stage 2's file is not; stage 3 runs again")
        if done == 0:
            self.info(f"resume: no stage result in {src}; running every stage")
            return 0, {}
        data: dict[str, Any] = {}
        own = self.out / STAGE_DIR
        if done >= 2:
            ckpt = load_checkpoint(src / STAGE_FILES[2])
            saved = ModelConfig.from_dict({**ckpt["model_config"], "pretrained": None})
            if saved != self._site_config:
                raise FedFewStop(f"resume: {src / STAGE_FILES[2]} was trained with model settings {saved.to_dict()}, "
                                 f"this job has {self._site_config.to_dict()}; remove 'resume' or match the settings")
            saved_cc = list(ckpt.get("fedfew_stage2", {}).get("cc_classes", ckpt["classes"][:-1]))
            if saved_cc != plan.cc_classes:
                raise FedFewStop(f"resume: {src / STAGE_FILES[2]} predicts the CCs {saved_cc}, the sites now give "
                                 f"{plan.cc_classes}; the stage-2 model cannot be reused")
            data["model_state"] = to_numpy(ckpt["model"])
            data["margins"] = dict(ckpt.get("fedfew_stage2", {}).get("margins", {}))
        if done == 3:
            data["stage3"] = json.loads((src / STAGE_FILES[3]).read_text())
        if done == 1:
            obj = torch.load(src / STAGE_FILES[1], map_location="cpu", weights_only=True)
            if not isinstance(obj, dict) or obj.get("format") != STAGE1_FORMAT:
                raise FedFewStop(f"resume: {src / STAGE_FILES[1]} is not a FedFew stage-1 file")
            saved = ModelConfig.from_dict({**obj["model_config"], "pretrained": None})
            if saved != self._site_config:
                raise FedFewStop(f"resume: {src / STAGE_FILES[1]} was trained with model settings {saved.to_dict()}, "
                                 f"this job has {self._site_config.to_dict()}")
            data["ssl_state"] = to_numpy(obj["ssl_state"])
        if src.resolve() != own.resolve():
            own.mkdir(parents=True, exist_ok=True)
            for k in sorted(have):
                if k <= done:
                    shutil.copy2(src / STAGE_FILES[k], own / STAGE_FILES[k])
        self.info(f"resume: stage(s) 1-{done} loaded from {src}; going on with stage {done + 1}" if done < 3
                  else f"resume: all three stages loaded from {src}; writing the final model")
        return done, data

    # ------------------------------------------------------------------ run
    def run(self) -> FedFewOutcome:
        """Run (or resume) the three stages; write and return the results.

        Raises:
            FedFewStop: nothing left to go on with (the message says why).
            FedFewAborted: the abort callable said so.
        """
        cfg = self.config
        self._path("cxrfl", "run_config.json").write_text(json.dumps({
            "fedfew_config": cfg.to_dict(), "model_config": self.model_config.to_dict(), "sites": self.sites,
            "min_clients": self.min_clients, "resume": str(self.resume) if self.resume else None,
            "cxrfl_version": cxrfl.__version__, "python": platform.python_version(), "torch": torch.__version__}, indent=2))
        plan = self._plan()
        done, resumed = self._load_resume(plan)
        skipped = list(range(1, done + 1))

        ssl_state = resumed.get("ssl_state")
        if done < 1:
            ssl_state = self._stage1(plan)
        if done < 2:
            model_state, margins = self._stage2(plan, ssl_state)
        else:
            model_state, margins = resumed["model_state"], resumed["margins"]
        if done < 3:
            stage3 = self._stage3(plan, model_state)
        else:
            stage3 = resumed["stage3"]
        prototypes = {uc: [DualPrototype.from_payload(p) for p in pairs] for uc, pairs in stage3["prototypes"].items()}
        final = self._path(GLOBAL_MODEL)
        extra = fedfew_extra(cc_classes=plan.cc_classes, threshold=stage3["threshold"], temperature=cfg.temperature,
                             energy_outputs=cfg.energy_outputs, prototypes=prototypes, margins=margins,
                             threshold_stats=stage3["threshold_stats"], min_prototype_images=cfg.min_prototype_images)
        save_checkpoint(final, {k: torch.as_tensor(np.asarray(v)) for k, v in model_state.items()},
                        classes=stage2_classes(plan.cc_classes), model_config=self.model_config,
                        extra={**extra, "method": "fedfew", "fedfew_config": cfg.to_dict()})
        ucs = sorted(uc for uc, p in prototypes.items() if p)
        self.info(f"final FedFew model: {final} ({len(plan.cc_classes)} CCs, UCs with prototypes: {ucs or 'none'}, "
                  f"energy threshold {stage3['threshold']:.4f})")
        if not ucs:
            self.warning("no UC has a prototype: the final model predicts the CCs only")
        evaluation = self._evaluate(plan, model_state, stage3, prototypes) if self.evaluate_test else None
        return FedFewOutcome(plan, ssl_state, model_state, dict(margins), float(stage3["threshold"]),
                             dict(stage3["threshold_stats"]), prototypes, dict(stage3.get("refused", {})), evaluation,
                             final, skipped)

    def _plan(self) -> ClassPlan:
        answers = self._broadcast(P.INFO, self.sites, {}, lambda s: self._meta())
        infos = {s: m["info"] for s, (_, m) in answers.items() if isinstance(m.get("info"), Mapping)}
        if not infos:
            raise FedFewStop("no site answered the info task (all failed at start: see their logs); nothing to train")
        plan = split_classes(infos, self.config)
        for note in plan.notes:
            self.warning(note)
        if not plan.cc_classes:
            raise FedFewStop("no common class: no site labels a class that counts as a CC "
                             f"(labelled classes: {sorted(set().union(*(set(i.get('classes', [])) for i in infos.values())))}); "
                             "stage 2 has nothing to learn. Check the site configs or fedfew.uc_classes")
        self._path("cxrfl", "plan.json").write_text(json.dumps(
            {**plan.to_dict(), "sites": {s: {k: v for k, v in i.items()} for s, i in infos.items()}}, indent=2))
        ucs = ", ".join(f"{c} ({'/'.join(plan.uc_sites[c])})" for c in plan.uc_classes) or "none"
        self.info(f"FedFew plan: {len(plan.cc_classes)} CC(s) labelled at {len(plan.cc_sites)} site(s); "
                  f"UCs: {ucs}; stage 1 at {len(plan.ssl_sites)} site(s), stages 2-3 at {len(plan.stage2_sites)}")
        return plan

    # ------------------------------------------------------------ stage 1
    def _stage1(self, plan: ClassPlan) -> dict[str, np.ndarray] | None:
        cfg = self.config
        torch.manual_seed(cfg.seed)
        init = build_model(self.model_config, 1)  # reads model_config.pretrained, if any
        model = ssl_model(self._site_config, cfg)
        model.backbone.load_state_dict(init.backbone.state_dict())
        state = to_numpy(model.state_dict())
        del init, model
        expected = {k: tuple(v.shape) for k, v in state.items()}
        contributed = False
        if cfg.ssl_rounds == 0:
            self.info("stage 1 (self-supervised): ssl_rounds = 0, skipped")
        elif not plan.ssl_sites:
            self.warning("stage 1 (self-supervised): no site has images for it; stage 2 starts from the initial weights")
        for rnd in range(1, cfg.ssl_rounds + 1 if plan.ssl_sites else 1):
            start = time.perf_counter()
            results = self._broadcast(P.SSL, plan.ssl_sites, state, lambda s, r=rnd: self._meta(round=r))
            agg, rejected, used = self._fedavg(results, expected, None)
            if agg is not None:
                state = agg
                contributed = True
            else:
                self.warning(f"stage 1 round {rnd}: only {len(used)} valid result(s) (min_clients={self.min_clients}); "
                             "keeping the previous weights")
            losses = [m["metrics"].get("ssl_loss") for _, m in results.values() if m.get("metrics", {}).get("ssl_loss") is not None]
            self._record({"stage": 1, "round": rnd, "sites_answered": sorted(results), "sites_aggregated": used if agg else [],
                          "rejected": rejected, "site_metrics": {s: m.get("metrics") for s, (_, m) in results.items()},
                          "seconds": time.perf_counter() - start})
            self.info(f"stage 1 round {rnd}/{cfg.ssl_rounds}: {len(used) if agg else 0} site(s) aggregated, mean SimSiam loss "
                      f"{np.mean(losses) if losses else float('nan'):.4f} ({time.perf_counter() - start:.1f}s)")
        if cfg.ssl_rounds and plan.ssl_sites and not contributed:
            self.warning("stage 1 (self-supervised): no round had enough valid results; stage 2 starts from the initial weights")
        obj = {"format": STAGE1_FORMAT, "ssl_state": {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()},
               "model_config": self._site_config.to_dict(), "fedfew_config": cfg.to_dict(), "contributed": contributed}
        atomic_write(self._path(STAGE_DIR, STAGE_FILES[1]), lambda f: torch.save(obj, f))
        self.info(f"stage 1 done: {self._path(STAGE_DIR, STAGE_FILES[1])}")
        return state

    # ------------------------------------------------------------ stage 2
    def _stage2(self, plan: ClassPlan, ssl_state: Mapping[str, np.ndarray] | None
                ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        cfg = self.config
        classes = stage2_classes(plan.cc_classes)
        torch.manual_seed(cfg.seed + 1)
        net = build_model(self.model_config, len(classes))
        if ssl_state is not None:
            enc = {k[len(ENCODER_PREFIX):]: torch.as_tensor(np.asarray(v)) for k, v in ssl_state.items() if k.startswith(ENCODER_PREFIX)}
            net.backbone.load_state_dict(enc)
        state = to_numpy(net.state_dict())
        del net
        expected = {k: tuple(v.shape) for k, v in state.items()}
        cc_sites = plan.cc_sites
        use_energy = cfg.energy_weight > 0
        warmup = cfg.warmup_rounds if (use_energy and not cfg.margins_given) else 0
        margins: dict[str, Any] = {"m_in": cfg.m_in, "m_out": cfg.m_out, "chosen": "config" if cfg.margins_given else None}
        if not use_energy:
            margins["chosen"] = "unused (energy_weight = 0)"
        if not plan.stage2_sites:
            raise FedFewStop("stage 2: no site has labelled training images; nothing to train")
        total = warmup + cfg.rounds
        aggregated_any = False
        for rnd in range(1, total + 1):
            in_warmup = rnd <= warmup
            if use_energy and not in_warmup and margins["chosen"] is None:
                margins = self._choose_margins(plan, state)
            weight = cfg.energy_weight if (use_energy and not in_warmup) else 0.0
            sites = plan.stage2_sites if weight > 0 else cc_sites
            start = time.perf_counter()
            results = self._broadcast(P.TRAIN, sites, state, lambda s, r=rnd, w=weight: self._meta(
                round=r, energy_weight=w, m_in=margins["m_in"], m_out=margins["m_out"], **self._roles(plan, s)))
            agg, rejected, used = self._fedavg(results, expected, classes)
            if agg is not None:
                state, aggregated_any = agg, True
            else:
                self.warning(f"stage 2 round {rnd}: only {len(used)} valid result(s) (min_clients={self.min_clients}); "
                             "keeping the previous weights")
            metrics = {s: m.get("metrics") for s, (_, m) in results.items()}
            losses = [m.get("train_loss") for m in metrics.values() if m and m.get("train_loss") is not None]
            phase = "warm-up" if in_warmup else ("energy" if weight > 0 else "bce")
            self._record({"stage": 2, "round": rnd, "phase": phase, "energy_weight": weight, "margins": margins,
                          "sites_answered": sorted(results), "sites_aggregated": used if agg else [], "rejected": rejected,
                          "site_metrics": metrics, "seconds": time.perf_counter() - start})
            self.info(f"stage 2 round {rnd}/{total} ({phase}): {len(used) if agg else 0} site(s) aggregated, mean train loss "
                      f"{np.mean(losses) if losses else float('nan'):.4f} ({time.perf_counter() - start:.1f}s)")
        if total and not aggregated_any:
            raise FedFewStop("stage 2: no round had enough valid results (see the sites' logs); there is no classifier")
        if use_energy and margins["chosen"] is None:  # rounds == 0: margins never needed
            margins["chosen"] = "unused (no energy round)"
        path = self._path(STAGE_DIR, STAGE_FILES[2])
        save_checkpoint(path, {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, classes=classes,
                        model_config=self.model_config,
                        extra={"fedfew_stage2": {"cc_classes": plan.cc_classes, "margins": margins, "rounds": total},
                               "fedfew_config": cfg.to_dict()})
        self.info(f"stage 2 done: {path}")
        return state, margins

    def _choose_margins(self, plan: ClassPlan, state: Mapping[str, np.ndarray]) -> dict[str, Any]:
        cfg = self.config
        results = self._broadcast(P.ENERGY, plan.stage2_sites, state, lambda s: self._meta(mode="means", **self._roles(plan, s)))
        stats = [m["stats"] for _, m in results.values() if isinstance(m.get("stats"), Mapping)]
        n_in = sum(int(s["n_in"]) for s in stats)
        n_out = sum(int(s["n_out"]) for s in stats)
        if n_in == 0:
            raise FedFewStop("stage 2: no site reported energies of CC-labelled images; the margins cannot be chosen")
        mean_in = sum(float(s["sum_in"]) for s in stats) / n_in
        if n_out == 0:
            self.warning("stage 2: no site reported UC-positive images; m_out is chosen from the CC energies alone")
            mean_out = mean_in
        else:
            mean_out = sum(float(s["sum_out"]) for s in stats) / n_out
        m_in, m_out = margins_from_means(mean_in, mean_out, cfg.margin_widen)
        if cfg.m_in is not None:
            m_in = float(cfg.m_in)
        if cfg.m_out is not None:
            m_out = float(cfg.m_out)
        self.info(f"stage 2 margins from the warm-up model: mean energy of CC images {mean_in:.4f} (n={n_in}), of UC "
                  f"images {mean_out:.4f} (n={n_out}) -> m_in {m_in:.4f}, m_out {m_out:.4f}")
        return {"m_in": m_in, "m_out": m_out, "chosen": "warm-up", "mean_in": mean_in, "mean_out": mean_out,
                "n_in": n_in, "n_out": n_out}

    # ------------------------------------------------------------ stage 3
    def _stage3(self, plan: ClassPlan, state: Mapping[str, np.ndarray]) -> dict[str, Any]:
        cfg = self.config
        start = time.perf_counter()
        sites = plan.stage2_sites
        ranges = self._broadcast(P.ENERGY, sites, state, lambda s: self._meta(mode="range", **self._roles(plan, s)))
        rs = {s: m["stats"] for s, (_, m) in ranges.items()
              if isinstance(m.get("stats"), Mapping) and m["stats"].get("min") is not None}
        chosen: dict[str, Any] | None = None
        if rs:
            grid = threshold_grid(min(float(r["min"]) for r in rs.values()), max(float(r["max"]) for r in rs.values()),
                                  cfg.threshold_bins)
            counts = self._broadcast(P.ENERGY, sorted(rs), state,
                                     lambda s: self._meta(mode="counts", grid=grid.tolist(), **self._roles(plan, s)))
            chosen = self._threshold_from_counts(grid, counts)
        if chosen is None:
            self.warning("stage 3: no usable threshold statistics (no site has UC positives or negatives"
                         f"{' or CC-labelled images' if cfg.threshold_examples == 'all' else ''}); the threshold is set to 0, "
                         "above every joint energy, so no image is flagged and the final model predicts the CCs only")
            chosen = {"threshold": 0.0, "errors": None, "accuracy": None, "balanced_accuracy": None, "n_in": 0, "n_out": 0,
                      "sites": [], "weighting": cfg.threshold_weighting, "note": "no statistics: flags nothing"}
        else:
            self.info(f"stage 3 threshold: {chosen['threshold']:.4f} classifies {chosen['accuracy']:.1%} of "
                      f"{chosen['n_in'] + chosen['n_out']} training examples correctly ({chosen['n_in']} without UC, "
                      f"{chosen['n_out']} with one)")
        # ---- prototypes, from the sites that label a UC
        holders = [s for s in sites if plan.site_ucs.get(s)]
        answers = self._broadcast(P.PROTOTYPES, holders, state, lambda s: self._meta(**self._roles(plan, s))) if holders else {}
        prototypes: dict[str, list[dict[str, Any]]] = {uc: [] for uc in plan.uc_classes}
        refused: dict[str, str] = {}
        for site, (_, m) in sorted(answers.items()):
            for uc, reason in dict(m.get("refused") or {}).items():
                refused[f"{uc}@{site}"] = reason
                self.warning(f"stage 3: no prototype of {uc} from site {site}: {reason}")
            for p in m.get("prototypes") or []:
                try:
                    proto = DualPrototype.from_payload(p)
                except (KeyError, TypeError, ValueError) as exc:
                    self.warning(f"stage 3: unusable prototype from site {site} ({exc}); left out")
                    continue
                if proto.uc not in plan.site_ucs.get(site, []):
                    self.warning(f"stage 3: site {site} sent a prototype of {proto.uc!r}, a class it was not asked for; left out")
                    continue
                if min(proto.n_positive, proto.n_negative) < cfg.min_prototype_images:
                    self.warning(f"stage 3: site {site} sent a prototype of {proto.uc} over fewer than "
                                 f"{cfg.min_prototype_images} images; left out")
                    continue
                dims = {len(q["positive"]) for q in sum(prototypes.values(), [])}
                if dims and len(proto.positive) not in dims:
                    self.warning(f"stage 3: prototype of {proto.uc} from site {site} has {len(proto.positive)} features, "
                                 f"others {sorted(dims)}; left out")
                    continue
                payload = proto.to_payload()
                payload["source"] = len(prototypes[proto.uc])
                prototypes[proto.uc].append(payload)
        for uc in plan.uc_classes:
            if not prototypes[uc]:
                self.warning(f"stage 3: UC {uc} has no prototype; the final model does not predict it")
        result = {"threshold": chosen["threshold"], "threshold_stats": chosen,
                  "prototypes": {uc: p for uc, p in prototypes.items() if p}, "refused": refused,
                  "prototype_counts": {uc: len(p) for uc, p in prototypes.items()}}
        self._record({"stage": 3, "threshold": chosen, "prototype_counts": result["prototype_counts"], "refused": refused,
                      "seconds": time.perf_counter() - start})
        path = self._path(STAGE_DIR, STAGE_FILES[3])
        atomic_write(path, lambda f: f.write(json.dumps(result, default=json_default)), mode="w")
        self.info(f"stage 3 done: {path}")
        return result

    def _threshold_from_counts(self, grid: np.ndarray, counts: dict[str, Message]) -> dict[str, Any] | None:
        """Sum the sites' error counts and choose the threshold (None when nothing is usable)."""
        cfg = self.config
        in_above = np.zeros(len(grid))
        out_below = np.zeros(len(grid))
        n_in = n_out = 0
        used = []
        for site, (_, m) in sorted(counts.items()):
            c = m.get("stats") or {}
            try:
                a, b = np.asarray(c["in_above"], float), np.asarray(c["out_below"], float)
                if a.shape != grid.shape or b.shape != grid.shape:
                    raise ValueError(f"{a.shape}/{b.shape} counts for {grid.shape} thresholds")
                ni, no = int(c["n_in"]), int(c["n_out"])
            except (KeyError, TypeError, ValueError) as exc:
                self.warning(f"stage 3: threshold counts of site {site} are unusable ({exc}); left out")
                continue
            in_above += a
            out_below += b
            n_in += ni
            n_out += no
            used.append(site)
        if n_in + n_out == 0:
            return None
        if n_out == 0:
            self.warning("stage 3: no UC-positive training image at any site; the threshold flags (almost) nothing")
        if n_in == 0:
            self.warning("stage 3: no training example without a UC; the threshold flags (almost) everything")
        chosen = choose_threshold(grid, in_above, out_below, n_in, n_out, cfg.threshold_weighting)
        chosen.update(n_in=n_in, n_out=n_out, sites=used, weighting=cfg.threshold_weighting,
                      examples=cfg.threshold_examples)
        return chosen

    # ----------------------------------------------------------- evaluation
    def _evaluate(self, plan: ClassPlan, state: Mapping[str, np.ndarray], stage3: Mapping[str, Any],
                  prototypes: Mapping[str, list[DualPrototype]]) -> dict[str, Any]:
        def meta(s: str) -> dict[str, Any]:
            own = [p.to_payload() for uc in plan.site_ucs.get(s, []) for p in prototypes.get(uc, [])]
            return self._meta(threshold=stage3["threshold"], prototypes=own, split="test", **self._roles(plan, s))

        results = self._broadcast(P.VALIDATE, plan.stage2_sites, state, meta)
        report: dict[str, Any] = {"cc_classes": plan.cc_classes, "uc_classes": plan.uc_classes,
                                  "threshold": stage3["threshold"], "sites": {}}
        for s, (_, m) in sorted(results.items()):
            report["sites"][s] = m.get("metrics", {})
            ev = report["sites"][s]
            parts = []
            if ev.get("cc_mean_auroc") is not None:
                parts.append(f"CC mean AUROC {ev['cc_mean_auroc']:.4f}")
            for uc, um in (ev.get("uc") or {}).items():
                parts.append(f"{uc} F1 {um['f1']:.3f} (P {um['precision']:.3f} R {um['recall']:.3f})")
            self.info(f"test split of site {s}: {'; '.join(parts) or 'nothing to evaluate'}")
        path = self._path("cxrfl", "evaluation.json")
        path.write_text(json.dumps(report, indent=2, default=json_default))
        self.info(f"evaluation written to {path}")
        return report

