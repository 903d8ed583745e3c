"""One seed of the FedFew benchmark: each method run once, with what it needs from another kept on disk.

``fedfew`` runs the three stages in-process (:func:`cxrfl.fedfew.inprocess.run_fedfew`: the job's
own workflow and site code) in ``WORK/seed<k>/fedfew``, probing stage 1's encoder
(:func:`~cxrfl.bench.fedfew.methods.linear_probe`) after the rounds of
:attr:`~cxrfl.bench.fedfew.settings.FedFewBenchSettings.probe_rounds`; ``fedfew-balanced`` re-runs stage 3 on
its stage-2 model with ``threshold_weighting: balanced``, ``fedfew-no-ebm`` stages 2-3 with
lambda = 0 from its stage 1 (``fedfew-no-ebm-prototype`` stage 3 again on that stage-2 model with the prototype
scorers), and the energy variants stages 2-3 with lambda = 1 / ``uc_negatives: in``
(all through ``resume_from``); ``nn-ssl``, ``mlc-ssl`` and ``mlc-surgical-ssl`` start from
its stage-1 encoder; ``nn-mlc-ssl`` uses the ``mlc-ssl`` network (kept as
``WORK/seed<k>/mlc-ssl.pt``). A method whose input is not on disk (a fresh work folder) makes it
first, so any method can run alone, e.g. when an interrupted benchmark goes on: only the stages it needs
(stage 1 for the ``-ssl`` methods and the stage-2 variants), going on from those already there. The folder is
emptied when it holds files of other settings (``WORK/seed<k>/settings.json``; the methods to run
and the number of parallel seeds do not count).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cxrfl.bench.fedfew.data import SeedData
from cxrfl.bench.fedfew.methods import MLC_CLASSES, eval_fedfew, eval_mlc, eval_nn, linear_probe, mean_uc_f1, train_mlc
from cxrfl.bench.fedfew.settings import FedFewBenchSettings, identity
from cxrfl.bench.intervals import finite_mean
from cxrfl.common.io import read_records, to_numpy
from cxrfl.common.server import RECORDS_DIR, RunAborted
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.inprocess import run_fedfew
from cxrfl.fedfew.ssl import load_encoder
from cxrfl.fedfew.stages import STAGE_DIR, STAGE_FILES
from cxrfl.nn.models import CXRNet, build_model, load_checkpoint, model_from_checkpoint, save_checkpoint

RUN_ORDER = (
    "fedfew",
    "fedfew-scorer",
    "fedfew-prototype",
    "fedfew-balanced",
    "fedfew-no-ebm",
    "fedfew-no-ebm-prototype",
    "mlc-surgical-ssl",
    "mlc-ssl",
    "nn-ssl",
    "nn-mlc-ssl",
    "fedfew-lambda1",
    "fedfew-neg-in",
    "mlc",
    "mlc-surgical",
    "mlc-pooled",
)
"""The order a seed's methods run in: each after what it reuses, the candidate and its closest references first,
then every method that reuses ``fedfew``'s stage files, then those that need none. A run stopped early has what
the targets compare, and one resumed on a machine without the stage files (``--work``) does not have to train
stage 1 again for a method that reuses it."""
PROTOTYPE = {"detector": "scorer", "scorer_model": "prototype"}
VARIANTS: dict[str, tuple[str, tuple[int, ...], dict[str, Any]]] = {
    "fedfew-balanced": ("fedfew", (1, 2), {"threshold_weighting": "balanced"}),
    "fedfew-scorer": ("fedfew", (1, 2), {"detector": "scorer"}),
    "fedfew-prototype": ("fedfew", (1, 2), PROTOTYPE),
    "fedfew-no-ebm": ("fedfew", (1,), {"energy_weight": 0.0}),
    "fedfew-no-ebm-prototype": ("fedfew-no-ebm", (1, 2), {"energy_weight": 0.0, **PROTOTYPE}),
    "fedfew-lambda1": ("fedfew", (1,), {"energy_weight": 1.0}),
    "fedfew-neg-in": ("fedfew", (1,), {"uc_negatives": "in"}),
}
"""A FedFew variant: the method whose stage files it reuses, which of them, and the settings it changes."""
RUN_ID = "run"
"""The run id of ``fedfew``'s stage files (their resume folder), which a later call resumes from."""


class SeedRun:
    """The methods of one seed.

    Args:
        settings: the benchmark settings.
        seed: the seed.
        data: the seed's sites and test sets.
        work: the work folder (stage files and models go to ``work/seed<k>``).
        log: progress lines.
    """

    def __init__(
        self, settings: FedFewBenchSettings, seed: int, data: SeedData, work: Path, log: Callable[[str], None]
    ) -> None:
        self.settings = settings
        self.seed = seed
        self.data = data
        self.folder = Path(work) / f"seed{seed}"
        self.log = log
        self.model_config = settings.model_config()
        self.config = FedFewConfig.from_dict({**settings.fedfew, "seed": seed})
        marker = self.folder / "settings.json"
        wanted = settings.identity()
        if (
            not marker.is_file() or identity(json.loads(marker.read_text())) != wanted
        ):  # other settings' files are never reused
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir(parents=True)
            marker.write_text(json.dumps(wanted, sort_keys=True))

    def run(self, method: str) -> dict[str, Any]:
        """Run one method and evaluate it.

        Args:
            method: one of :data:`RUN_ORDER`.

        Returns:
            its test results (``mean_cc_auroc``, ``mean_uc_f1``, ``uc``: per UC accuracy,
            precision, recall, F1 ...) and ``seconds``.
        """
        start = time.perf_counter()
        if method == "fedfew":
            result = self._fedfew()
        elif method in VARIANTS:
            result = self._variant(method)
        elif method == "nn-ssl":
            encoder = build_model(self.model_config, 1)
            load_encoder(encoder, self._ssl_state())
            result = eval_nn(encoder, self.data, self.settings)
        elif method == "mlc":
            model, training = train_mlc(self.data, self.settings, self.seed, None, self.log)
            result = {**eval_mlc(model, self.data, self.settings), "training": training}
        elif method in ("mlc-surgical", "mlc-pooled", "mlc-surgical-ssl"):
            mode = method.removeprefix("mlc-").removesuffix("-ssl")
            ssl = self._ssl_state() if method.endswith("-ssl") else None
            model, training = train_mlc(self.data, self.settings, self.seed, ssl, self.log, mode=mode)
            result = {**eval_mlc(model, self.data, self.settings), "training": training}
        elif method == "mlc-ssl":
            model, training = self._mlc_ssl()
            result = {**eval_mlc(model, self.data, self.settings), "training": training}
        elif method == "nn-mlc-ssl":
            result = eval_nn(self._mlc_ssl()[0], self.data, self.settings)
        else:
            raise ValueError(f"unknown method {method!r}; available: {list(RUN_ORDER)}")
        result["seconds"] = round(time.perf_counter() - start, 1)
        return mean_uc_f1(result)

    # ------------------------------------------------------------------ FedFew
    def _stages(self, last: int = 2) -> Path:
        """``fedfew``'s stage files up to stage ``last``, run when they are not there: from the stages already
        there (through ``resume_from``), stopping once stage ``last``'s file is written (a method that needs
        only stage 1's encoder does not pay for stage 2 on a machine without the stage files).

        Args:
            last: the last stage needed (1 or 2).
        """
        out = self.folder / "fedfew"
        stages = out / STAGE_DIR
        if all((stages / STAGE_FILES[k]).is_file() for k in range(1, last + 1)):
            return stages
        try:
            run_fedfew(
                self.data.train,
                self.config,
                out,
                model_config=self.model_config,
                device=torch.device(self.settings.device),
                resume_from=RUN_ID if (stages / STAGE_FILES[1]).is_file() else None,
                info=lambda m: self.log("  " + m),
                warning=lambda m: self.log("  WARNING " + m),
                aborted=lambda: (stages / STAGE_FILES[last]).is_file(),
            )
        except RunAborted:  # stage ``last`` is written: the next stage stops at its first message
            pass
        return stages

    def _fedfew(self, evaluate: bool = True) -> dict[str, Any]:
        out = self.folder / "fedfew"
        shutil.rmtree(out, ignore_errors=True)
        probes: list[dict[str, Any]] = []

        def probe(stage: int, rnd: int, params: Any) -> None:
            if stage == 1 and rnd in self.settings.probe_rounds:
                start = time.perf_counter()
                p = {"round": rnd, **linear_probe(params, self.data, self.settings)}
                probes.append({**p, "seconds": round(time.perf_counter() - start, 1)})
                self.log(f"  stage-1 linear probe after {rnd} round(s): mean CC AUROC {p['mean_auroc']:.3f}")

        outcome = run_fedfew(
            self.data.train,
            self.config,
            out,
            run_id=RUN_ID,
            model_config=self.model_config,
            device=torch.device(self.settings.device),
            info=lambda m: self.log("  " + m),
            warning=lambda m: self.log("  WARNING " + m),
            on_round=probe,
        ).outcome
        if not evaluate:
            return {}
        result = eval_fedfew(outcome.final_path, self.data, self.settings)
        result.update(
            margins=outcome.margins,
            threshold_stats=outcome.threshold_stats,
            ssl_probe=probes,
            stage2=stage2_summary(out),
            detector=outcome.detector,
            detectors={uc: [(d.n_positive, d.n_negative) for d in ds] for uc, ds in outcome.detectors.items()},
        )
        return result

    def _variant_stages(self, method: str, last: int) -> Path:
        """The stage files of ``method`` (``fedfew`` or a variant) up to stage ``last``, run when not there."""
        if method == "fedfew":
            return self._stages(last)
        stages = self.folder / method / STAGE_DIR
        if not all((stages / STAGE_FILES[k]).is_file() for k in range(1, last + 1)):
            self._variant(method)  # its evaluation is not kept: the method runs (and is stored) on its own
        return stages

    def _variant(self, method: str) -> dict[str, Any]:
        source_method, reused, changes = VARIANTS[method]
        stages = self._variant_stages(source_method, max(reused))
        out = self.folder / method
        shutil.rmtree(out, ignore_errors=True)
        source = out / "reused"
        source.mkdir(parents=True)
        for k in reused:
            shutil.copy2(stages / STAGE_FILES[k], source / STAGE_FILES[k])
        outcome = run_fedfew(
            self.data.train,
            self.config.replace(**changes),
            out,
            model_config=self.model_config,
            device=torch.device(self.settings.device),
            resume_root=out,
            resume_from=source.name,
            info=lambda m: None,
            warning=lambda m: self.log("  WARNING " + m),
        ).outcome
        result = eval_fedfew(outcome.final_path, self.data, self.settings)
        result.update(threshold_stats=outcome.threshold_stats, stage2=stage2_summary(out))
        return result

    def _ssl_state(self) -> dict[str, Any]:
        obj = torch.load(self._stages(1) / STAGE_FILES[1], map_location="cpu", weights_only=True)
        return to_numpy(obj["ssl_state"])

    # --------------------------------------------------------------------- MLC
    def _mlc_ssl(self) -> tuple[CXRNet, dict[str, Any]]:
        """The MLC network trained from the stage-1 encoder and its training record (trained once per
        seed, then read back)."""
        path = self.folder / "mlc-ssl.pt"
        if path.is_file():
            model, _, _ = model_from_checkpoint(path)
            return model, dict(load_checkpoint(path).get("training") or {})
        model, training = train_mlc(self.data, self.settings, self.seed, self._ssl_state(), self.log)
        save_checkpoint(
            path, model, classes=list(MLC_CLASSES), model_config=self.model_config, extra={"training": training}
        )
        return model, training


def stage2_summary(out: Path) -> dict[str, Any]:
    """Stage 2's rounds per phase from a run's records: how many ran, the best round and its CC validation
    loss, per round the CC validation loss and the CC sites' mean validation AUROC (``curve``), and per round
    the sites' mean training-time energies (``energy``: ``in``, ``out``, ``uc_neg``, each
    the mean over the sites that have such images) with ``uc_energy_gap``, UC positives minus UC negatives
    at the best round (does stage 2 open the gap the threshold needs, on the UC sites' own images?).

    Args:
        out: the run's output folder.
    """
    phases: dict[str, dict[str, Any]] = {}
    for r in read_records(out / RECORDS_DIR / "rounds.jsonl"):
        if r.get("stage") != 2 or r.get("status"):
            continue
        p = phases.setdefault(
            r["phase"], {"rounds": 0, "best_round": None, "best_val_loss": None, "curve": [], "energy": []}
        )
        p["rounds"] += 1
        loss = r.get("val_loss")
        if loss is not None and (p["best_val_loss"] is None or loss < p["best_val_loss"]):
            p["best_round"], p["best_val_loss"] = r["round"], loss
        aurocs = [v.get("cc_mean_auroc") for v in (r.get("site_validation") or {}).values()]
        p["curve"].append({"round": r["round"], "val_loss": loss, "val_cc_auroc": finite_mean(aurocs)})
        p["energy"].append({"round": r["round"], **_site_energies(r.get("site_metrics") or {})})
    for p in phases.values():
        best: dict[str, Any] = next((e for e in p["energy"] if e["round"] == p["best_round"]), {})
        gap = None if best.get("out") is None or best.get("uc_neg") is None else best["out"] - best["uc_neg"]
        p["uc_energy_gap"] = gap
    return phases


def _site_energies(site_metrics: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """One round's training-time energies (``train_energy_<group>``), each the mean over the sites reporting it."""
    means: dict[str, float | None] = {}
    for group in ("in", "out", "uc_neg"):
        values = [
            m[f"train_energy_{group}"] for m in site_metrics.values() if m.get(f"train_energy_{group}") is not None
        ]
        means[group] = sum(values) / len(values) if values else None
    return means
