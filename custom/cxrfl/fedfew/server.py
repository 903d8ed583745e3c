"""The server side of FedFew: the three stages as one workflow, over any transport.

:class:`FedFewServer` is a :class:`cxrfl.fedfew.rounds.FederatedRounds` (a
:class:`cxrfl.common.server.ServerLoop`): it plans and runs the stages and talks to the sites only
through ``send`` (:mod:`cxrfl.common.transport`). The NVFlare job (:mod:`cxrfl.fl.fedfew`) and the
benchmark and tests (:mod:`cxrfl.fedfew.inprocess`) run this same workflow.

0. ``fedfew_info``: every site's class names and label counts. CCs and UCs are told apart
   (:func:`cxrfl.fedfew.plan.split_classes`); sites without labelled images take part in stage 1 only.
1. Federated SimSiam: FedAvg (weighted by images) of encoder, projector and predictor
   (:mod:`cxrfl.fedfew.stage1`).
2. Energy-based multi-label training over the CCs + "no CC": FedAvg weighted by labelled
   images. Unless both margins are configured, warm-up rounds without the energy term come
   first (CC sites only: the UC sites have no other loss) and the margins are chosen from the
   warm-up model's mean energies (:func:`cxrfl.fedfew.energy.margins_from_means`). With
   ``patience`` set, the CC sites score every new model on their validation split
   (``fedfew_validate``, ``split: val``): each phase stops early and keeps its model of lowest
   validation loss (:class:`cxrfl.common.selection.EarlyStopping`). See :mod:`cxrfl.fedfew.stage2`.
3. Energy threshold from the sites' error counts on a common grid (two passes: the sites' energy
   ranges make the grid, then each site counts its errors per candidate; examples: see
   :data:`cxrfl.fedfew.config.THRESHOLD_EXAMPLES`); one detector per UC from each UC site (dual
   prototypes or a scorer, per ``detector``; refused at the site below the minimum number of
   images). See :mod:`cxrfl.fedfew.stage3` and :mod:`cxrfl.fedfew.detectors`.

Faults (:mod:`cxrfl.fedfew.rounds`): malformed results are rejected one line each; a round (or
the start's ``fedfew_info``) with fewer than ``min_clients`` valid results is run again every
``retry_pause`` seconds until ``min_clients_timeout``, then the run stops with the reason.

Written under ``out_dir`` (the server's app folder in a job):

- ``fedfew/stage1_ssl.pt``, ``fedfew/stage2_model.pt``, ``fedfew/stage3.json``: the stage
  results (:mod:`cxrfl.fedfew.stages`);
- ``FL_global_model.pt``: the final self-describing model (:mod:`cxrfl.fedfew.model`);
- ``cxrfl/rounds.jsonl``: one record per round attempt of stages 1-2 and one for stage 3;
  ``cxrfl/plan.json``: the classes and roles; ``cxrfl/evaluation.json``: the final model on every
  site's test split (:mod:`cxrfl.fedfew.evaluation`); ``cxrfl/run_config.json``: the settings.

Resuming: every finished stage's file is kept in the run's resume folder (a hard link, not a copy)
(``cxrfl_resume/<run id>/`` under ``resume_root``; removed when the run finishes), and so is the
stage in progress after each completed round (``state.pt``: its weights, best weights, early
stopping, margins). A run with ``resume_from`` set to an interrupted run's id (its resume folder
under ``resume_root``; no other folder) loads the latest finished stage there and goes on with the
next one, from the round after the last completed one when that stage's progress is there (and was
made with the same settings);
stage 3 also needs stage 2's file. The model settings and the CCs must match, otherwise the run
stops and says why.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cxrfl.clinical.pooling import PooledEvaluation
from cxrfl.common.io import link_or_copy, write_json
from cxrfl.common.server import GLOBAL_MODEL, RunStopped
from cxrfl.common.transport import Send
from cxrfl.fedfew import protocol as P
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.detectors import PAYLOAD_KEYS, Detector, parse_detectors
from cxrfl.fedfew.evaluation import evaluate_final
from cxrfl.fedfew.model import save_fedfew_model
from cxrfl.fedfew.plan import ClassPlan, split_classes
from cxrfl.fedfew.rounds import FederatedRounds, Progress, RoundHook
from cxrfl.fedfew.stage1 import run_stage1
from cxrfl.fedfew.stage2 import run_stage2
from cxrfl.fedfew.stage3 import run_stage3
from cxrfl.fedfew.stages import STAGE_DIR, STAGE_FILES, finished_stages, load_stages
from cxrfl.nn.models import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class FedFewOutcome:
    """What a finished run produced (also in the files under ``out_dir``)."""

    plan: ClassPlan
    ssl_state: dict[str, np.ndarray] | None
    model_state: dict[str, np.ndarray]
    margins: dict[str, Any]
    threshold: float
    threshold_stats: dict[str, Any]
    detector: str
    detectors: dict[str, list[Detector]]
    refused: dict[str, str]
    evaluation: dict[str, Any] | None
    final_path: Path
    skipped_stages: list[int]


class FedFewServer(FederatedRounds):
    """The FedFew workflow.

    Args:
        send: the transport (see the module docstring).
        sites: the sites to use.
        config: FedFew settings.
        model_config: network settings (``pretrained`` is read here, for the initial encoder).
        out_dir: where results are written.
        min_clients: fewest valid results that make a round.
        min_clients_timeout: seconds a round with fewer valid results is retried before the run stops.
        retry_pause: seconds between two attempts at a round.
        evaluate_test: evaluate the final model on every site's test split.
        run_id: this run's id (NVFlare: the job id); names its resume folder.
        resume_root: folder of resume folders (default ``out_dir/cxrfl_resume``).
        resume_from: an interrupted run's id (see the module docstring).
        info: logger of progress lines.
        warning: logger of problems that do not stop the run.
        aborted: returns True when the run must stop.
        on_round: called after every completed round of stages 1-2 (:data:`cxrfl.fedfew.rounds.RoundHook`).
    """

    def __init__(
        self,
        send: Send,
        *,
        sites: Sequence[str],
        config: FedFewConfig,
        model_config: ModelConfig,
        out_dir: str | Path,
        min_clients: int = 1,
        min_clients_timeout: float = 600,
        retry_pause: float = 10,
        evaluate_test: bool = True,
        pooled: PooledEvaluation | None = None,
        run_id: str = "run",
        resume_root: str | Path | None = None,
        resume_from: str | None = None,
        info: Callable[[str], None] = log.info,
        warning: Callable[[str], None] = log.warning,
        aborted: Callable[[], bool] = lambda: False,
        on_round: RoundHook | None = None,
    ) -> None:
        super().__init__(
            send=send,
            sites=sites,
            out_dir=out_dir,
            run_id=run_id,
            resume_root=resume_root,
            resume_from=str(resume_from) if resume_from else None,
            info=info,
            warning=warning,
            aborted=aborted,
            min_clients=min_clients,
            min_clients_timeout=min_clients_timeout,
            retry_pause=retry_pause,
            on_round=on_round,
            robust=config.robust,
            clip_norm=config.clip_norm,
            max_num_samples=config.max_num_samples,
        )
        self.config = config
        self.model_config = model_config
        self.evaluate_test = evaluate_test
        self.pooled = pooled or PooledEvaluation()
        self._site_ccs: dict[str, list[str]] = {}  # site -> the CCs it labels (from its info), for the pooling
        self._site_config = ModelConfig.from_dict({**model_config.to_dict(), "pretrained": None})
        # the federation's UC list stays here: a site learns its own UCs from its tasks' uc_classes (_site_meta)
        self._site_fedfew = dataclasses.replace(config, uc_classes=None)

    # -------------------------------------------------------------- helpers
    def _meta(self, **extra: Any) -> dict[str, Any]:
        return {"fedfew_config": self._site_fedfew.to_dict(), "model_config": self._site_config.to_dict(), **extra}

    def _site_meta(self, plan: ClassPlan, site: str, **extra: Any) -> dict[str, Any]:
        """A stage-2/3 task's meta for ``site`` (:data:`cxrfl.fedfew.protocol.SiteMeta`): its roles, its own UCs
        only."""
        return self._meta(**extra, cc_classes=plan.cc_classes, uc_classes=plan.site_ucs.get(site, []))

    # ---------------------------------------------------------- stage files
    def _stage_path(self, stage: int) -> Path:
        return self.path(STAGE_DIR, STAGE_FILES[stage])

    def _keep(self, stage: int) -> None:
        """Keep a finished stage's file in this run's resume folder."""
        link_or_copy(self._stage_path(stage), self.resume.folder / STAGE_FILES[stage])

    def _resume_source(self) -> Path:
        """The resume folder of the run ``resume_from`` names."""
        folder = self.resume.locate(self.resume_from).parent
        if not folder.is_dir():
            raise RunStopped(
                f"resume_from={self.resume_from!r}: {folder} does not exist; give the job id of an interrupted FedFew "
                f"run on this server, or remove resume_from"
            )
        return folder

    def _load_resume(self, plan: ClassPlan) -> tuple[int, dict[str, Any], Progress | None]:
        """The latest finished stage of ``resume_from``, its data, and the next stage's progress (0, {}, None: none)."""
        if not self.resume_from:
            return 0, {}, None
        src = self._resume_source()
        done, have = finished_stages(src)
        if 3 in have and done < 3:
            self.warning(f"resume: {src / STAGE_FILES[3]} is there but stage 2's file is not; stage 3 runs again")
        progress = self.load_progress(src, done + 1) if done < 3 else None
        if progress is not None:
            self.save_progress(progress)  # a run resumed in turn finds it in this run's folder
        if done == 0:
            if progress is None:
                self.info(f"resume: no stage result in {src}; running every stage")
            return 0, {}, progress
        data = load_stages(src, done, self._site_config, plan.cc_classes)
        for k in range(1, done + 1):
            if k in have:
                if src.resolve() != self._stage_path(k).parent.resolve():
                    link_or_copy(src / STAGE_FILES[k], self._stage_path(k))
                self._keep(k)
        self.info(
            f"resume: stage(s) 1-{done} loaded from {src}; going on with stage {done + 1}"
            if done < 3
            else f"resume: all three stages loaded from {src}; writing the final model"
        )
        return done, data, progress

    # ------------------------------------------------------------------ run
    def run(self) -> FedFewOutcome:
        """Run (or resume) the three stages; write and return the results.

        Raises:
            RunStopped: nothing left to go on with (the message says why).
            RunAborted: the abort callable said so.
        """
        cfg = self.config
        self.info(
            f"FedFew: {len(self.sites)} site(s), {cfg.ssl_rounds} self-supervised round(s), at most "
            f"{cfg.warmup_rounds}+{cfg.rounds} classifier round(s) (patience {cfg.patience}), "
            f"resume_from={self.resume_from}"
        )
        self.write_run_config(
            {
                "fedfew_config": cfg.to_dict(),
                "model_config": self.model_config.to_dict(),
                "sites": self.sites,
                "min_clients": self.min_clients,
                "min_clients_timeout": self.clock.timeout,
                "retry_pause": self.clock.pause,
                "run_id": self.run_id,
                "resume_from": self.resume_from,
            }
        )
        plan = self._plan()
        self.progress_settings = {
            "fedfew_config": cfg.to_dict(),
            "model_config": self._site_config.to_dict(),
            "cc_classes": plan.cc_classes,
            "uc_classes": plan.uc_classes,
        }
        done, ssl_state, model_state, margins, stage3 = self._run_stages(plan)
        kind = str(stage3.get("detector", "paper"))  # stage 3 files of older runs hold prototypes
        if kind != cfg.detector:
            raise RunStopped(
                f"stage 3 of the resumed run used detector {kind!r}, this run's settings say {cfg.detector!r}; "
                "resume with the same fedfew.detector or start a new run"
            )
        stored = stage3.get(PAYLOAD_KEYS[kind]) or {}
        detectors = parse_detectors(kind, [p for pairs in stored.values() for p in pairs])
        final = self._write_final(plan, model_state, margins, stage3, detectors)
        evaluation = self._evaluate(plan, model_state, stage3, detectors) if self.evaluate_test else None
        self.resume.clear()
        return FedFewOutcome(
            plan,
            ssl_state,
            model_state,
            dict(margins),
            float(stage3["threshold"]),
            dict(stage3["threshold_stats"]),
            kind,
            detectors,
            dict(stage3.get("refused", {})),
            evaluation,
            final,
            list(range(1, done + 1)),
        )

    def _run_stages(
        self, plan: ClassPlan
    ) -> tuple[int, dict[str, np.ndarray] | None, dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
        """Load what ``resume_from`` finished, run the other stages and keep each one's file.

        Returns:
            the number of stages loaded, the SimSiam weights, the stage-2 weights, the margins, stage 3's result.
        """
        cfg = self.config
        done, resumed, progress = self._load_resume(plan)
        meta = functools.partial(self._site_meta, plan)
        ssl_state = resumed.get("ssl_state")
        if done < 1:
            ssl_state = run_stage1(
                self,
                plan,
                progress,
                config=cfg,
                model_config=self.model_config,
                site_config=self._site_config,
                meta_for=lambda s, r: self._meta(round=r),
                path=self._stage_path(1),
            )
            self._keep(1)
            progress = None
        if done < 2:
            model_state, margins = run_stage2(
                self,
                plan,
                ssl_state,
                progress,
                config=cfg,
                model_config=self.model_config,
                meta=meta,
                path=self._stage_path(2),
            )
            self._keep(2)
        else:
            model_state, margins = resumed["model_state"], resumed["margins"]
        if done < 3:
            stage3 = run_stage3(self, plan, model_state, config=cfg, meta=meta, path=self._stage_path(3))
            self._keep(3)
        else:
            stage3 = resumed["stage3"]
        return done, ssl_state, model_state, margins, stage3

    def _write_final(
        self,
        plan: ClassPlan,
        model_state: Mapping[str, np.ndarray],
        margins: Mapping[str, Any],
        stage3: Mapping[str, Any],
        detectors: Mapping[str, list[Detector]],
    ) -> Path:
        cfg = self.config
        final = self.path(GLOBAL_MODEL)
        save_fedfew_model(
            final,
            model_state,
            plan.cc_classes,
            stage3,
            detectors,
            margins=margins,
            config=cfg,
            model_config=self.model_config,
        )
        ucs = sorted(uc for uc, d in detectors.items() if d)
        what = PAYLOAD_KEYS[cfg.detector]
        self.info(
            f"final FedFew model: {final} ({len(plan.cc_classes)} CCs, UCs with {what}: {ucs or 'none'}, "
            f"energy threshold {stage3['threshold']:.4f})"
        )
        if not ucs:
            self.warning(f"no UC has {what}: the final model predicts the CCs only")
        return final

    def _infos(self) -> dict[str, Mapping[str, Any]]:
        """Every site's ``info`` answer, asked again until ``min_clients`` sites answer or the timeout stops the run."""
        while True:
            answers = self.broadcast(P.INFO, self.sites, {}, lambda s: self._meta())
            infos = {s: m["info"] for s, (_, m) in answers.items() if isinstance(m.get("info"), Mapping)}
            if infos and len(infos) >= self.min_clients:
                self.clock.succeeded()
                return infos
            who = f"only {sorted(infos)}" if infos else "no site"
            self.retry_or_stop(
                f"{who} answered the info task at the start (min_clients={self.min_clients})",
                setting="min_clients_timeout",
                kept="the others failed at start or are down: see their logs",
                step=None,
            )

    def _plan(self) -> ClassPlan:
        infos = self._infos()
        plan = split_classes(infos, self.config)
        self._site_ccs = {s: [c for c in plan.cc_classes if c in (i.get("classes") or [])] for s, i in infos.items()}
        for note in plan.notes:
            self.warning(note)
        if not plan.cc_classes:
            raise RunStopped(
                "no common class: no site labels a class that counts as a CC "
                f"(labelled classes: {sorted(set().union(*(set(i.get('classes', [])) for i in infos.values())))}); "
                "stage 2 has nothing to learn. Check the site configs or fedfew.uc_classes"
            )
        write_json(self.path("cxrfl", "plan.json"), {**plan.to_dict(), "sites": {s: dict(i) for s, i in infos.items()}})
        ucs = ", ".join(f"{c} ({'/'.join(plan.uc_sites[c])})" for c in plan.uc_classes) or "none"
        self.info(
            f"FedFew plan: {len(plan.cc_classes)} CC(s) labelled at {len(plan.cc_sites)} site(s); "
            f"UCs: {ucs}; stage 1 at {len(plan.ssl_sites)} site(s), stages 2-3 at {len(plan.stage2_sites)}"
        )
        return plan

    def _evaluate(
        self,
        plan: ClassPlan,
        state: Mapping[str, np.ndarray],
        stage3: Mapping[str, Any],
        detectors: Mapping[str, list[Detector]],
    ) -> dict[str, Any]:
        """The final model on every stage-2 site's test split (:func:`cxrfl.fedfew.evaluation.evaluate_final`)."""
        return evaluate_final(
            self,
            plan,
            state,
            stage3,
            detectors,
            detector=self.config.detector,
            site_ccs=self._site_ccs,
            pooled=self.pooled,
            meta=functools.partial(self._site_meta, plan),
        )
