"""Server workflow of surgical aggregation: head warm-up, federated rounds, evaluation.

Each site receives the feature extractor and only the head rows of its own classes (one task
per site), and never a name of another site's classes. Results are validated and stitched by
:class:`cxrfl.fl.aggregator.SurgicalAggregator`.

The same workflow runs the papers' federated baselines through ``head_mode`` (see
:mod:`cxrfl.surgical.head_modes`): ``union`` heads (vanilla FL with ``missing="negative"``, FL with
partial loss with ``missing="ignore"``; every site then receives the whole head and every class
name, so the privacy property above no longer holds) and ``local`` heads (personalized FL: only
the feature extractor travels; there is no global head, ``FL_global_model.pt`` holds the
feature extractor only and the external test set is not evaluated).

Training stops on the mean of the sites' validation BCE of the received global model (patience,
min delta) or after ``num_rounds``.
Written to the server's app folder:

- ``FL_global_model.pt``: the latest global model (a self-describing cxrfl checkpoint);
- ``best_FL_global_model.pt``: the global model with the lowest mean validation loss;
- ``cxrfl/rounds.jsonl``: one aggregation record per round (sites, contributors per class,
  rejections, losses and AUROCs); ``cxrfl/checkpoints/round_NNN.pt`` when kept;
- ``cxrfl/evaluation.json``: the best model on every site's test split and an external set;
- ``cxrfl/run_config.json``: the settings of this run.

Faults: a site that fails, times out or dies is left out of the round (its task ends when
NVFlare deems it dead, or after ``task_timeout``); invalid results are rejected one log line
each. A round with fewer than ``min_clients`` valid results keeps the previous global model and
is run again, until ``min_clients_timeout`` seconds have passed without a completed round: then
the job stops and says why. After the warm-up and every completed round the server keeps what
it needs to go on (``<server workspace>/cxrfl_resume/<job id>/``); a job stopped by a server
crash or an abort continues from its last completed round when submitted again with
``resume_from`` set to the interrupted job's id (or that folder's path).
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.workflows.model_controller import ModelController

import cxrfl
from cxrfl.surgical.head_modes import PLACEHOLDER_CLASS, check_modes, drop_head, payload_for, with_placeholder_head
from cxrfl.data.site import load_site
from cxrfl.errors import ConfigError, CxrflError
from cxrfl.nn.evaluation import evaluate_on_site, shared_classes
from cxrfl.fl.aggregator import SurgicalAggregator
from cxrfl.nn.metrics import summarise_auroc
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, batchnorm_keys, build_model, save_checkpoint
from cxrfl.common.io import append_record, json_default
from cxrfl.common.io import to_numpy
from cxrfl.surgical.learner import BATCHNORM_MODES
from cxrfl.nn.training import TrainConfig

GLOBAL_MODEL = "FL_global_model.pt"
BEST_MODEL = "best_FL_global_model.pt"
RETRY_PAUSE = 10.0  # seconds between two attempts at a round that had too few valid results
RESUME_ROOT = "cxrfl_resume"
RESUME_STATE = "state.pt"
# settings a resumed run must share with the interrupted one
RESUME_KEYS = ("model_config", "batchnorm", "head_mode", "missing", "seed")


def run_site_tasks(ctl: ModelController, task_name: str, payloads: dict[str, FLModel], timeout: int) -> dict[str, FLModel]:
    """Send one non-blocking task per site (each its own payload) and wait until all have ended.

    Args:
        ctl: the running controller.
        task_name: the task to send.
        payloads: site -> what that site receives.
        timeout: seconds a site may take (0: no limit).

    Returns:
        the sites that answered, by name (failed or timed-out sites are absent).
    """
    results: dict[str, FLModel] = {}

    def collect(result: FLModel) -> bool:
        results[result.meta["client_name"]] = result
        return True

    for site, data in payloads.items():
        ctl.send_model(task_name=task_name, data=data, targets=[site], callback=collect, timeout=timeout)
    while ctl.get_num_standing_tasks() > 0:
        if ctl.abort_signal.triggered:
            break
        time.sleep(0.2)
    return results


class SurgicalAggregation(ModelController):
    """Surgical aggregation for class-heterogeneous federated multi-label learning.

    Args:
        num_rounds: maximum number of federated rounds after the warm-up.
        min_clients: fewest valid site results that make a round; fewer keep the previous model.
        model_config: :class:`cxrfl.nn.models.ModelConfig` fields.
        train_config: :class:`cxrfl.nn.training.TrainConfig` fields (sent to the sites).
        batchnorm: ``fedavg``, ``fedbn`` (BatchNorm local) or ``fedbn+`` (frozen at initial statistics).
        weighting: ``uniform`` (the papers) or ``samples``.
        robust: None, ``median`` or ``clip`` robust aggregation (off by default).
        clip_norm: update norm bound for ``robust="clip"``.
        patience: rounds without improvement of the mean validation loss before stopping.
        min_delta: improvement smaller than this does not count.
        task_timeout: seconds a site may take per task (0: no limit; a dead site's task still ends
            when NVFlare deems the site dead).
        min_clients_timeout: seconds without a completed round (fewer than ``min_clients`` valid
            results, the round is run again) before the job stops with the reason.
        resume_from: continue an interrupted run of this job: its job id on this server, or the
            path of its ``cxrfl_resume/<job id>`` folder.
        seed: seed of the initial weights.
        evaluate_test: evaluate the best model on every site's test split at the end.
        external_test: server-side site config of a fully annotated external test set (optional).
        keep_round_checkpoints: keep every round's global model under ``cxrfl/checkpoints``.
        head_mode: ``surgical`` (default: own head rows per site), ``union`` (whole head to every
            site: vanilla FL / partial loss) or ``local`` (heads stay at the sites: personalized FL).
        missing: for ``union`` heads, classes a site does not annotate are ``negative`` (vanilla
            FL) or ``ignore``-d in its loss (FL with partial loss).
    """

    def __init__(
        self,
        *,
        num_rounds: int = 20,
        min_clients: int = 2,
        model_config: dict | None = None,
        train_config: dict | None = None,
        batchnorm: str = "fedavg",
        weighting: str = "uniform",
        robust: str | None = None,
        clip_norm: float | None = None,
        patience: int = 5,
        min_delta: float = 1e-4,
        task_timeout: int = 0,
        min_clients_timeout: float = 600,
        resume_from: str | None = None,
        seed: int = 0,
        evaluate_test: bool = True,
        external_test: str | None = None,
        keep_round_checkpoints: bool = True,
        head_mode: str = "surgical",
        missing: str = "negative",
    ) -> None:
        super().__init__(persistor_id="", ignore_result_error=True)
        check_modes(head_mode, missing)
        if num_rounds < 0 or min_clients < 1 or patience < 1 or task_timeout < 0 or min_clients_timeout < 0:
            raise ValueError("num_rounds >= 0, min_clients >= 1, patience >= 1, task_timeout >= 0 and "
                             "min_clients_timeout >= 0 are required")
        if batchnorm not in BATCHNORM_MODES:
            raise ValueError(f"batchnorm must be one of {BATCHNORM_MODES}, got {batchnorm!r}")
        self.num_rounds = num_rounds
        self.min_clients = min_clients
        self.model_config = ModelConfig.from_dict(model_config or {})
        self.train_config = TrainConfig.from_dict(train_config or {})
        self.batchnorm = batchnorm
        self.patience = patience
        self.min_delta = min_delta
        self.task_timeout = task_timeout
        self.min_clients_timeout = min_clients_timeout
        self.resume_from = resume_from
        self.seed = seed
        self.evaluate_test = evaluate_test
        self.external_test = external_test
        self.keep_round_checkpoints = keep_round_checkpoints
        self.head_mode = head_mode
        self.missing = missing
        self._run_key = ""  # the job id of the run's first job: names the sites' state across resumes
        self.aggregator = SurgicalAggregator(weighting=weighting, batchnorm=batchnorm, robust=robust, clip_norm=clip_norm)
        self._settings = {
            "num_rounds": num_rounds, "min_clients": min_clients, "batchnorm": batchnorm, "weighting": weighting,
            "robust": robust, "clip_norm": clip_norm, "patience": patience, "min_delta": min_delta, "seed": seed,
            "task_timeout": task_timeout, "min_clients_timeout": min_clients_timeout, "resume_from": resume_from,
            "model_config": self.model_config.to_dict(), "train_config": self.train_config.to_dict(),
            "head_mode": head_mode, "missing": missing,
        }

    # ------------------------------------------------------------- helpers
    def _out(self, *parts: str) -> Path:
        path = Path(self.get_app_dir()).joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _task_meta(self, **extra: Any) -> dict[str, Any]:
        return {
            "model_config": self.model_config.to_dict(),
            "train_config": self.train_config.to_dict(),
            "batchnorm": self.batchnorm,
            "head_mode": self.head_mode,
            "missing": self.missing,
            "run_key": self._run_key,
            **extra,
        }

    def _run_tasks(self, task_name: str, payloads: dict[str, FLModel]) -> dict[str, FLModel]:
        """Send one task per site (each its own payload) and wait for all of them to end."""
        return run_site_tasks(self, task_name, payloads, self.task_timeout)

    def _save(self, name: str, state: dict[str, np.ndarray], classes: list[str], **extra: Any) -> Path:
        path = self._out(name)
        tensors = {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}
        save_checkpoint(path, tensors, classes=classes, model_config=self.model_config,
                        extra={"head_mode": self.head_mode, **extra})
        return path

    def _record(self, record: dict[str, Any]) -> None:
        append_record(self._out("cxrfl", "rounds.jsonl"), record)

    def _accept(self, results: dict[str, FLModel], expected: dict[str, tuple], announced: dict[str, list[str]] | None,
                classes: list[str] | None = None, reference: dict[str, np.ndarray] | None = None):
        """Validate the results; returns (aggregated FLModel or None when too few are valid, rejections)."""
        if self.head_mode == "local":  # feature extractor only: a server-side one-row stand-in head
            results = {s: _with_placeholder(r) for s, r in results.items()}
            announced = {s: [PLACEHOLDER_CLASS] for s in announced} if announced else None
            classes, reference = None, None
        self.aggregator.fl_ctx = self.fl_ctx
        self.aggregator.expect(expected, announced, classes, reference)
        for result in results.values():
            self.aggregator.accept_model(result)
        rejected = dict(self.aggregator.rejected)
        if len(self.aggregator.accepted_sites) < self.min_clients:
            self.warning(
                f"only {len(self.aggregator.accepted_sites)} valid result(s) (min_clients={self.min_clients}); "
                f"keeping the previous global model"
            )
            self.aggregator.reset_stats()
            return None, rejected
        try:
            agg = self.aggregator.aggregate_model()
        except (ValueError, CxrflError) as exc:  # e.g. finite values whose sum overflows: never a crash
            self.error(f"aggregation failed, keeping the previous global model: {exc}")
            self.aggregator.reset_stats()
            return None, {**rejected, "aggregation": str(exc)}
        if self.head_mode == "local":
            agg.params = drop_head(agg.params)
            agg.meta.update(classes=[], contributors={})
        return agg, rejected

    # -------------------------------------------------------------- resume
    def _resume_dir(self, job_id: str) -> Path:
        workspace = self.fl_ctx.get_engine().get_workspace()
        return Path(workspace.get_root_dir()) / RESUME_ROOT / job_id

    def _save_resume(self, rnd: int, state: dict[str, np.ndarray], classes: list[str], announced: dict[str, list[str]],
                     best: dict[str, Any], best_state: dict[str, np.ndarray] | None) -> None:
        """Keep what a resumed run needs after the warm-up (``rnd`` 0) or a completed round (atomic write)."""
        folder = self._resume_dir(self.fl_ctx.get_job_id())
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{RESUME_STATE}.tmp"
        torch.save({"round": rnd, "params": state, "classes": classes, "announced": announced, "best": best,
                    "best_params": best_state, "run_key": self._run_key, "settings": self._settings}, tmp)
        tmp.replace(folder / RESUME_STATE)

    def _load_resume(self) -> dict[str, Any]:
        """The state of the interrupted run named by ``resume_from``; raises ConfigError when unusable."""
        given = Path(self.resume_from)
        folder = given if given.is_absolute() else self._resume_dir(self.resume_from)
        path = folder / RESUME_STATE
        if not path.is_file():
            raise ConfigError(
                f"resume_from={self.resume_from!r}: {path} does not exist; give the job id of an interrupted run "
                f"of this job on this server (or the path of its {RESUME_ROOT}/<job id> folder), or remove resume_from"
            )
        state = torch.load(path, map_location="cpu", weights_only=False)
        differ = [k for k in RESUME_KEYS if state["settings"].get(k) != self._settings.get(k)]
        if differ:
            raise ConfigError(f"resume_from={self.resume_from!r}: the interrupted run used other settings for "
                              f"{differ}; resume with the same settings or start a new run")
        return state

    # ----------------------------------------------------------------- run
    def run(self) -> None:
        self.info(f"surgical aggregation: up to {self.num_rounds} rounds, batchnorm={self.batchnorm}, "
                  f"head_mode={self.head_mode}, missing={self.missing}")
        self._run_key = self.fl_ctx.get_job_id()
        resumed = None
        if self.resume_from:
            try:
                resumed = self._load_resume()
            except ConfigError as exc:
                self.panic(str(exc))
                return
            self._run_key = resumed["run_key"]
        self._out("cxrfl", "run_config.json").write_text(
            json.dumps({**self._settings, "cxrfl_version": cxrfl.__version__, "python": platform.python_version(),
                        "torch": torch.__version__, "external_test": self.external_test}, indent=2)
        )
        torch.manual_seed(self.seed)
        init = build_model(self.model_config, 1)
        bn_keys = set(batchnorm_keys(init))
        self.aggregator.bn_keys = tuple(sorted(bn_keys))
        global_state = {k: v for k, v in to_numpy(init.state_dict()).items() if not k.startswith(HEAD_PREFIX)}
        del init
        local_bn = self.batchnorm != "fedavg"
        expected = {k: v.shape for k, v in global_state.items() if not (local_bn and k in bn_keys)}

        if resumed is None:
            # ---- head warm-up: sites announce their classes with their warmed-up rows
            sites = self.sample_clients()
            warm = self._run_tasks(
                "train",
                {s: FLModel(params_type=ParamsType.FULL, params=global_state, current_round=0, total_rounds=self.num_rounds,
                            meta=self._task_meta(phase="warmup", round=0)) for s in sites},
            )
            agg, rejected = self._accept(warm, expected, None)
            if agg is None:
                self.panic(f"head warm-up produced too few valid results (rejected: {rejected}); stopping")
                return
            announced = {s: list(warm[s].meta["classes"]) for s in agg.meta["sites"]}
            classes = list(agg.meta["classes"])
            global_state.update(agg.params)
            best = {"loss": float("inf"), "round": 0, "stale": 0}
            start_round = 1
            self._save_resume(0, global_state, classes, announced, best, None)
            self._record(self._round_record(0, "warmup", sites, warm, agg, rejected))
        else:
            global_state, classes, announced, best = (resumed["params"], resumed["classes"], resumed["announced"],
                                                       resumed["best"])
            start_round = resumed["round"] + 1
            self._record({"round": resumed["round"], "phase": "resumed", "resumed_from": self.resume_from,
                          "run_key": self._run_key})
            self.info(f"resumed {self.resume_from} after its round {resumed['round']}: continuing with round {start_round}")
        shared = shared_classes(announced)
        # a union head: every site sends (and is checked against) every class
        expected_classes = {s: classes for s in announced} if self.head_mode == "union" else announced
        self.info(f"global classes: {len(classes)} ({len(shared)} shared by 2+ sites)")
        path = self._save(GLOBAL_MODEL, global_state, classes, round=start_round - 1)
        best_state = dict(global_state)
        if resumed is not None and resumed.get("best_params") is not None:
            best_state = resumed["best_params"]
            self._save(BEST_MODEL, best_state, classes, round=best["round"], mean_val_loss=best["loss"])

        # ---- federated rounds; a round without min_clients valid results is run again
        rnd, waiting_since = start_round, None
        while rnd <= self.num_rounds:
            if self.abort_signal.triggered:
                return
            start = time.perf_counter()
            payloads = {}
            for s, site_classes in announced.items():
                params, sent_classes = payload_for(global_state, classes, site_classes, head_mode=self.head_mode,
                                                   exclude=bn_keys if self.batchnorm == "fedbn" else ())
                payloads[s] = FLModel(params_type=ParamsType.FULL, params=params, current_round=rnd,
                                      total_rounds=self.num_rounds,
                                      meta=self._task_meta(phase="train", round=rnd, classes=sent_classes))
            evaluated_state = dict(global_state)
            results = self._run_tasks("train", payloads)
            if self.abort_signal.triggered:  # aborted mid-round: the round is not recorded, nothing is written
                return
            agg, rejected = self._accept(results, expected, expected_classes, classes, evaluated_state)
            losses = [r.meta["metrics"]["val_loss"] for r in results.values()
                      if r.meta.get("metrics", {}).get("val_loss") is not None and np.isfinite(r.meta["metrics"]["val_loss"])]
            mean_loss = float(np.mean(losses)) if losses else float("nan")
            record = self._round_record(rnd, "train", list(announced), results, agg, rejected)
            record.update(mean_val_loss_of_previous_global=mean_loss, seconds=time.perf_counter() - start)
            if agg is None:
                self._record(record)
                waiting_since = waiting_since if waiting_since is not None else time.monotonic()
                waited = time.monotonic() - waiting_since
                if waited >= self.min_clients_timeout:
                    reason = (f"stopping: round {rnd} had fewer than min_clients={self.min_clients} valid site results "
                              f"for {waited:.0f}s (min_clients_timeout={self.min_clients_timeout:g}); answered "
                              f"{record['sites_answered']}, failed {record['sites_failed']}, rejected {rejected}. "
                              f"The last completed round ({rnd - 1}) is in {path}; resume with resume_from="
                              f"{self.fl_ctx.get_job_id()!r} once enough sites are back")
                    self._record({"round": rnd, "phase": "stopped", "reason": reason})
                    self.panic(reason)
                    return
                self.warning(f"round {rnd}: too few valid results; running it again in {RETRY_PAUSE:g}s "
                             f"({waited:.0f}s of min_clients_timeout={self.min_clients_timeout:g}s)")
                pause_end = time.monotonic() + RETRY_PAUSE
                while time.monotonic() < pause_end and not self.abort_signal.triggered:
                    time.sleep(0.5)
                continue
            waiting_since = None
            global_state.update(agg.params)
            path = self._save(GLOBAL_MODEL, global_state, classes, round=rnd)
            if self.keep_round_checkpoints:
                self._save(f"cxrfl/checkpoints/round_{rnd:03d}.pt", global_state, classes, round=rnd)
            self.info(f"round {rnd}: {len(agg.meta['sites'])} of {len(announced)} site(s) aggregated, mean val loss of "
                      f"round {rnd - 1} model {mean_loss:.4f} ({time.perf_counter() - start:.1f}s)")
            stop = False
            if np.isfinite(mean_loss) and mean_loss < best["loss"] - self.min_delta:
                best = {"loss": mean_loss, "round": rnd - 1, "stale": 0}
                best_state = evaluated_state
                self._save(BEST_MODEL, best_state, classes, round=best["round"], mean_val_loss=best["loss"])
            else:
                best["stale"] += 1
                if best["stale"] >= self.patience:
                    self.info(f"early stop: no improvement for {best['stale']} rounds (best round {best['round']})")
                    stop = True
            self._save_resume(rnd, global_state, classes, announced, best, best_state)
            self._record(record)  # last: a recorded round is a round a resumed run does not redo
            if stop:
                break
            rnd += 1
        if not self._out(BEST_MODEL).exists():
            self._save(BEST_MODEL, global_state, classes, round=self.num_rounds)
            best_state = global_state
        self.info(f"global model: {path}; best (round {best['round']}): {self._out(BEST_MODEL)}")
        self._evaluate(best_state, classes, announced, shared, bn_keys)
        shutil.rmtree(self._resume_dir(self.fl_ctx.get_job_id()), ignore_errors=True)  # finished: nothing to resume

    def _round_record(self, rnd: int, phase: str, sent: list[str], results: dict[str, FLModel], agg: FLModel | None,
                      rejected: dict[str, str]) -> dict[str, Any]:
        metrics = {s: {k: v for k, v in r.meta.get("metrics", {}).items()} for s, r in results.items()}
        return {
            "round": rnd,
            "phase": phase,
            "sites_answered": sorted(results),
            "sites_failed": sorted(set(sent) - set(results)),
            "sites_aggregated": list(agg.meta["sites"]) if agg else [],
            "contributors": agg.meta["contributors"] if agg else {},
            "rejected": rejected,
            "aggregated": agg is not None,
            "site_metrics": metrics,
        }

    def _evaluate(self, state: dict[str, np.ndarray], classes: list[str], announced: dict[str, list[str]],
                  shared: list[str], bn_keys: set[str]) -> None:
        report: dict[str, Any] = {"classes": classes, "shared_classes": shared, "sites": {}, "external": None}
        if self.evaluate_test:
            payloads = {}
            for s, site_classes in announced.items():
                params, sent_classes = payload_for(state, classes, site_classes, head_mode=self.head_mode,
                                                   exclude=bn_keys if self.batchnorm == "fedbn" else ())
                payloads[s] = FLModel(params_type=ParamsType.FULL, params=params,
                                      meta=self._task_meta(split="test", classes=sent_classes))
            for s, r in self._run_tasks("validate", payloads).items():
                m = r.meta.get("metrics", {})
                own = {c: v for c, v in m.get("auroc", {}).items() if c in announced.get(s, ())}  # a union head: own classes
                report["sites"][s] = {**m, **summarise_auroc(own, shared=shared)}
        if self.external_test and self.head_mode == "local":
            self.info("personalized FL (local heads) has no global model: the external test set is not evaluated")
        elif self.external_test:
            try:
                model = build_model(self.model_config, len(classes))
                model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()})
                data = load_site(self.external_test)
                ext = evaluate_on_site(model, classes, data, image_size=self.model_config.image_size, splits=None)
                ext.update(summarise_auroc(ext["auroc"], shared=shared))
                report["external"] = {"site": data.site, **ext}
                self.info(f"external test {data.site}: mean AUROC {ext['mean']}")
            except CxrflError as exc:
                self.error(f"external test set could not be evaluated: {exc}")
        path = self._out("cxrfl", "evaluation.json")
        path.write_text(json.dumps(report, indent=2, default=json_default))
        self.info(f"evaluation written to {path}")


def _with_placeholder(result: FLModel) -> FLModel:
    """A copy of a head-less site result with a one-row stand-in head (aggregated, then dropped)."""
    meta = {**(result.meta or {}), "classes": [PLACEHOLDER_CLASS]}
    return FLModel(params_type=result.params_type, params=with_placeholder_head(drop_head(result.params or {})), meta=meta)
