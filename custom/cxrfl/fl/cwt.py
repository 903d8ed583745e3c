"""NVFlare glue of cyclical weight transfer: the relay controller and the site executor.

The controller is a small :class:`ModelController` in the spirit of NVFlare's own
``nvflare.app_common.workflows.cyclic.Cyclic`` (which relays one model from site to site but
neither skips a site that fails nor stops early). It

1. sends a ``counts`` task to every site: each answers its number of training and validation
   images (and, for the multi-label task, its class names) and nothing else;
2. turns the training sizes into each site's steps and learning rate (:func:`cxrfl.cwt.relay_plan`:
   PLTI and CLR when switched on);
3. every cycle, sends the model to one site at a time, in a fixed or seeded-shuffled order; the
   weights a site returns are the weights the next site receives. A site whose task fails, times
   out, or returns an unusable model is skipped with a log line and the model goes on unchanged;
4. after each cycle, sends the model to every site for a ``validate`` task; the pooled validation
   loss decides early stopping (patience in cycles) and which cycle's model is kept (never the
   untrained initial one).

LWMS and CWL happen inside the sites (:class:`cxrfl.cwt.CWTSite`) from their own label counts.

Written to the server's app folder:

- ``FL_global_model.pt``: the model after the last cycle (a self-describing cxrfl checkpoint);
- ``best_FL_global_model.pt``: the model of the cycle with the lowest pooled validation loss;
- ``cxrfl/plan.json``: per site its training size, steps and learning rate;
- ``cxrfl/visits.jsonl``: one record per visit, in relay order: site, status (trained or
  skipped and why), SHA-256 of the weights sent and received by the server, and of the weights
  the site loaded and returned as the site computed them — so anyone can check that the
  weights that left site k are the weights site k+1 started from;
- ``cxrfl/cycles.jsonl``: one record per cycle (order, sites trained and skipped, pooled val loss);
- ``cxrfl/evaluation.json``: the best model on every site's test split (loss, accuracy, AUROC);
- ``cxrfl/run_config.json``: the settings of this run.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.app_common.workflows.model_controller import ModelController

import cxrfl
from cxrfl.common.io import append_record, json_default
from cxrfl.surgical.aggregation import validate_update
from cxrfl.common.io import params_digest
from cxrfl.cwt.config import CWTConfig
from cxrfl.cwt.relay import load_optimizer_arrays, optimizer_arrays, relay_order, relay_plan, split_params, Visit
from cxrfl.cwt.site import CWTSite, eval_summary, global_classes, pooled_loss
from cxrfl.errors import UpdateRejected
from cxrfl.fl.controller import run_site_tasks
from cxrfl.fl.executor import SiteExecutor, _fmt
from cxrfl.nn.metrics import summarise_auroc
from cxrfl.nn.models import ModelConfig, build_model, save_checkpoint, select_device
from cxrfl.common.io import to_numpy
from cxrfl.nn.training import adam

GLOBAL_MODEL = "FL_global_model.pt"
BEST_MODEL = "best_FL_global_model.pt"
COUNTS_TASK = "counts"
TRAIN_TASK = "train"
VALIDATE_TASK = "validate"


def _site_model_config(model_config: dict[str, Any]) -> ModelConfig:
    """The network skeleton on a site: the weights arrive from the relay, no local file is read."""
    return ModelConfig.from_dict({**model_config, "pretrained": None})


class CyclicWeightTransfer(ModelController):
    """Cyclical weight transfer with the four optimizations of Balachandar et al. (2020).

    Args:
        cwt_config: :class:`cxrfl.cwt.CWTConfig` fields (task, cycles, order, PLTI, CLR, LWMS,
            CWL, learning rate, batch size, patience ...; sent to the sites).
        model_config: :class:`cxrfl.nn.models.ModelConfig` fields (``pretrained`` is read here,
            on the server, for the initial weights only).
        site_order: the fixed relay order (sites not listed follow in name order); None: by name.
            With ``order: shuffled`` it only fixes the list the permutations are drawn from.
        min_sites: fewest sites that must answer the counts task for the relay to start.
        task_timeout: seconds a site may take per task (0: no limit). A site that is down when
            its turn comes is skipped after this long, so set it in deployments.
        evaluate_test: evaluate the best model on every site's test split at the end.
    """

    def __init__(
        self,
        *,
        cwt_config: dict | None = None,
        model_config: dict | None = None,
        site_order: list[str] | None = None,
        min_sites: int = 1,
        task_timeout: int = 0,
        evaluate_test: bool = True,
    ) -> None:
        super().__init__(persistor_id="", ignore_result_error=True)
        if isinstance(min_sites, bool) or not isinstance(min_sites, int) or min_sites < 1:
            raise ValueError(f"min_sites must be an integer >= 1, got {min_sites!r}")
        if isinstance(task_timeout, bool) or not isinstance(task_timeout, int) or task_timeout < 0:
            raise ValueError(f"task_timeout must be an integer >= 0, got {task_timeout!r}")
        self.config = CWTConfig.from_dict(cwt_config)
        self.model_config = ModelConfig.from_dict(model_config or {})
        if site_order is not None and (isinstance(site_order, str) or len(set(site_order)) != len(site_order)):
            raise ValueError(f"site_order must be a list of distinct site names, got {site_order!r}")
        self.site_order = list(site_order) if site_order is not None else None
        self.min_sites = min_sites
        self.task_timeout = task_timeout
        self.evaluate_test = evaluate_test

    # ------------------------------------------------------------- helpers
    def _out(self, *parts: str) -> Path:
        path = Path(self.get_app_dir()).joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _append(self, name: str, record: dict[str, Any]) -> None:
        append_record(self._out("cxrfl", name), record)

    def _meta(self, classes: list[str] | None = None, **extra: Any) -> dict[str, Any]:
        return {"cwt_config": self.config.to_dict(), "model_config": self.model_config.to_dict(), "classes": classes, **extra}

    def _save(self, name: str, state: dict[str, np.ndarray], classes: list[str], **extra: Any) -> Path:
        path = self._out(name)
        save_checkpoint(path, {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, classes=classes,
                        model_config=self.model_config, extra={"method": self.config.method, "cwt_config": self.config.to_dict(), **extra})
        return path

    def _all_sites(self, task_name: str, payloads: dict[str, FLModel]) -> dict[str, FLModel]:
        """One task per site in parallel; the sites that answered, by name."""
        return run_site_tasks(self, task_name, payloads, self.task_timeout)

    def _connected(self) -> set[str]:
        return {c.name for c in self.engine.get_clients()}

    def _check(self, result: FLModel | None, site: str, classes: list[str], shapes: dict[str, tuple], n: int) -> str | None:
        """Why a site's result cannot go on to the next site, or None."""
        if result is None:
            return "its task failed or timed out"
        params, _ = split_params(result.params or {})
        try:
            validate_update({"site": site, "classes": classes, "num_samples": max(n, 1), "params": params},
                            expected_shapes=shapes)
        except UpdateRejected as exc:
            return f"unusable result: {exc}"
        return None

    def _validate(self, state: dict[str, np.ndarray], sites: list[str], classes: list[str], split: str) -> dict[str, dict]:
        payloads = {s: FLModel(params_type=ParamsType.FULL, params=state, meta=self._meta(classes, split=split)) for s in sites}
        results = {s: r.meta.get("metrics", {}) for s, r in self._all_sites(VALIDATE_TASK, payloads).items()}
        missing = [s for s in sites if s not in results]
        if missing:
            self.warning(f"no {split} result from {', '.join(missing)} (down or failing); pooled over the others")
        return results

    # ----------------------------------------------------------------- run
    def run(self) -> None:
        cfg = self.config
        self.info(f"cyclical weight transfer ({cfg.method}, task {cfg.task}): up to {cfg.num_cycles} cycles, "
                  f"order {cfg.order}, optimizer state {cfg.optimizer_state}")
        self._out("cxrfl", "run_config.json").write_text(json.dumps({
            "cwt_config": cfg.to_dict(), "model_config": self.model_config.to_dict(), "site_order": self.site_order,
            "min_sites": self.min_sites,
            "task_timeout": self.task_timeout, "method": cfg.method, "cxrfl_version": cxrfl.__version__,
            "python": platform.python_version(), "torch": torch.__version__}, indent=2))

        # ---- 1. counts only: training/validation sizes (and class names for multi-label)
        sites = self.sample_clients()
        answers = self._all_sites(COUNTS_TASK, {
            s: FLModel(params_type=ParamsType.FULL, params={}, meta=self._meta()) for s in sites})
        counts: dict[str, dict[str, Any]] = {}
        for s in sites:
            c = answers[s].meta.get("counts") if s in answers else None
            if c is None:
                self.warning(f"site {s} did not answer the counts task (down or failing); it is left out of the relay")
            elif int(c.get("n_train", 0)) <= 0:
                self.warning(f"site {s} has no training images; it is left out of the relay")
            else:
                counts[s] = c
        if len(counts) < self.min_sites:
            self.panic(f"only {len(counts)} site(s) can take part (min_sites={self.min_sites}); stopping")
            return
        rank = {s: i for i, s in enumerate(self.site_order or [])}
        relay = sorted(counts, key=lambda s: (rank.get(s, len(rank)), s))
        classes = global_classes(cfg.task, {s: c.get("classes") or [] for s, c in counts.items()})
        if not classes:
            self.panic("the sites announced no class; stopping")
            return
        plan = relay_plan({s: int(c["n_train"]) for s, c in counts.items()}, cfg)
        self._out("cxrfl", "plan.json").write_text(json.dumps({
            "classes": classes,
            "sites": {s: {"n_train": int(counts[s]["n_train"]), "n_val": int(counts[s].get("n_val", 0)),
                          "steps": plan[s].steps, "lr": plan[s].lr} for s in relay}}, indent=2))
        self.info("relay plan: " + ", ".join(f"{s} {plan[s].steps} steps at lr {plan[s].lr:.3g}" for s in relay)
                  + f"; {len(classes)} output(s)")

        # ---- 2. the relay
        torch.manual_seed(cfg.seed)
        init = build_model(self.model_config, len(classes))
        state = to_numpy(init.state_dict())
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        del init
        opt_state: dict[str, np.ndarray] = {}
        best_loss, best_cycle, best_state, stale = math.inf, 0, dict(state), 0
        path = self._save(GLOBAL_MODEL, state, classes, cycle=0)
        for cycle in range(1, cfg.num_cycles + 1):
            start = time.perf_counter()
            order = relay_order(relay, cycle, cfg.order, cfg.seed)
            trained, skipped = [], {}
            for position, site in enumerate(order):
                if self.abort_signal.triggered:
                    return
                sent = params_digest(state)
                record: dict[str, Any] = {"cycle": cycle, "position": position, "site": site, "sent_digest": sent}
                if site not in self._connected():
                    result, problem = None, "it is not connected"
                else:
                    payload = FLModel(
                        params_type=ParamsType.FULL, params={**state, **opt_state}, current_round=cycle,
                        total_rounds=cfg.num_cycles,
                        meta=self._meta(classes, cycle=cycle, position=position, steps=plan[site].steps, lr=plan[site].lr),
                    )
                    results = self.send_model_and_wait(task_name=TRAIN_TASK, data=payload, targets=[site], timeout=self.task_timeout)
                    result = results[0] if results else None
                    problem = self._check(result, site, classes, shapes, int(counts[site]["n_train"]))
                if problem:
                    skipped[site] = problem
                    record.update(status="skipped", reason=problem)
                    self.warning(f"cycle {cycle}: site {site} skipped ({problem}); the model goes on to the next site unchanged")
                else:
                    params, opt = split_params(result.params)
                    state = {k: np.asarray(v) for k, v in params.items()}
                    opt_state = {k: np.asarray(v) for k, v in opt.items()} if cfg.optimizer_state == "travel" else {}
                    m = dict(result.meta.get("metrics", {}))
                    record.update(status="trained", received_digest=params_digest(state),
                                  site_received_digest=m.pop("received_digest", None),
                                  site_returned_digest=m.pop("returned_digest", None), metrics=m)
                    trained.append(site)
                self._append("visits.jsonl", record)
            val = self._validate(state, relay, classes, "val")
            loss = pooled_loss([(m.get("loss", math.nan), m.get("n_known", 0)) for m in val.values()])
            self._append("cycles.jsonl", {"cycle": cycle, "order": order, "trained": trained, "skipped": skipped,
                                          "val_loss": loss, "sites_validated": sorted(val),
                                          "seconds": time.perf_counter() - start})
            path = self._save(GLOBAL_MODEL, state, classes, cycle=cycle, val_loss=loss)
            self.info(f"cycle {cycle} ({' > '.join(order)}): {len(trained)} site(s) trained, {len(skipped)} skipped, "
                      f"pooled val loss {loss:.4f} ({time.perf_counter() - start:.1f}s)")
            if math.isfinite(loss) and (best_cycle == 0 or loss < best_loss - cfg.min_delta):
                best_loss, best_cycle, best_state, stale = loss, cycle, dict(state), 0
                self._save(BEST_MODEL, best_state, classes, cycle=cycle, val_loss=loss)
            else:
                stale += 1
                if stale >= cfg.patience:
                    self.info(f"early stop: no improvement for {stale} cycles (best cycle {best_cycle})")
                    break
        if best_cycle == 0:
            self._save(BEST_MODEL, best_state, classes, cycle=0, val_loss=best_loss)
        self.info(f"global model: {path}; best (cycle {best_cycle}, pooled val loss {best_loss:.4f}): {self._out(BEST_MODEL)}")
        self._evaluate(best_state, relay, classes, best_cycle)

    def _evaluate(self, state: dict[str, np.ndarray], sites: list[str], classes: list[str], best_cycle: int) -> None:
        report: dict[str, Any] = {"classes": classes, "method": self.config.method, "best_cycle": best_cycle, "sites": {}}
        if self.evaluate_test:
            for s, m in self._validate(state, sites, classes, "test").items():
                report["sites"][s] = {**m, "auroc_summary": summarise_auroc(m.get("auroc") or {})}
            report["pooled_loss"] = pooled_loss([(m.get("loss", math.nan), m.get("n_known", 0)) for m in report["sites"].values()])
        path = self._out("cxrfl", "evaluation.json")
        path.write_text(json.dumps(report, indent=2, default=json_default))
        self.info(f"evaluation written to {path}")


class CWTExecutor(SiteExecutor):
    """A site of the relay: answers ``counts``, ``train`` (its turn) and ``validate`` tasks.

    Finds and checks the site's data like :class:`cxrfl.fl.executor.SiteExecutor` (same config
    resolution, same start-up checks, same arguments); the task settings come from the server.
    """

    def __init__(self, device: str = "auto", num_workers: int = 0, num_threads: int = 0,
                 analytic_sender_id: str = "analytic_sender") -> None:
        super().__init__(device=device, num_workers=num_workers, num_threads=num_threads, analytic_sender_id=analytic_sender_id)
        self.cwt_site: CWTSite | None = None
        self._site_key: tuple | None = None
        self._model: torch.nn.Module | None = None
        self._model_key: tuple | None = None

    def _get_site(self, fl_ctx: FLContext, meta: dict[str, Any]) -> CWTSite:
        cfg = CWTConfig.from_dict(meta.get("cwt_config"))
        mcfg = _site_model_config(meta.get("model_config") or {})
        classes = meta.get("classes")
        key = (cfg, mcfg, tuple(classes) if classes else None)
        if self.cwt_site is None or key != self._site_key:
            self.cwt_site = CWTSite(self.data, cfg, mcfg, classes=classes, device=select_device(self.device_name),
                                    num_workers=self.num_workers)
            self._site_key = key
            for w in self.cwt_site.warnings:
                self.log_warning(fl_ctx, w)
        return self.cwt_site

    def _load_model(self, site: CWTSite, params: dict[str, Any]) -> torch.nn.Module:
        key = (site.model_config, len(site.classes))
        if self._model is None or key != self._model_key:
            self._model = build_model(site.model_config, len(site.classes)).to(site.device)
            self._model_key = key
        self._model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in params.items()}, strict=True)
        return self._model

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        if self.error:
            self.log_error(fl_ctx, f"site {self.site}: refusing task {task_name}: {self.error}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        try:
            incoming = FLModelUtils.from_shareable(shareable)
            meta = dict(incoming.meta or {})
            site = self._get_site(fl_ctx, meta)
            if abort_signal.triggered:
                return make_reply(ReturnCode.TASK_ABORTED)
            if task_name == COUNTS_TASK:
                counts = site.counts()
                self.log_info(fl_ctx, f"site {self.site}: sending counts {counts}")
                out = FLModel(params_type=ParamsType.FULL, params={}, meta={"counts": counts})
            elif task_name == TRAIN_TASK:
                out = self._train(fl_ctx, site, incoming.params or {}, meta)
            elif task_name == VALIDATE_TASK:
                split = str(meta.get("split", "val"))
                model = self._load_model(site, split_params(incoming.params or {})[0])
                metrics = eval_summary(site.evaluate(model, split))
                self.log_info(fl_ctx, f"site {self.site} {split}: loss {_fmt(metrics['loss'])} accuracy "
                                      f"{_fmt(metrics['accuracy'])} mean AUROC {_fmt(metrics['mean_auroc'])}")
                out = FLModel(params_type=ParamsType.FULL, params={}, meta={"metrics": metrics})
            else:
                self.log_error(fl_ctx, f"site {self.site}: unknown task {task_name!r}")
                return make_reply(ReturnCode.TASK_UNKNOWN)
        except Exception as exc:  # one bad visit must not take the relay down: the server skips this site
            self.log_exception(fl_ctx, f"site {self.site}: task {task_name} failed: {exc}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        return FLModelUtils.to_shareable(out)

    def _train(self, fl_ctx: FLContext, site: CWTSite, params: dict[str, Any], meta: dict[str, Any]) -> FLModel:
        weights, opt_in = split_params(params)
        model = self._load_model(site, weights)
        received = params_digest(to_numpy(model.state_dict()))
        cfg = site.config
        visit = Visit(steps=int(meta["steps"]), lr=float(meta["lr"]))
        optimizer = adam(model, visit.lr, cfg.weight_decay)
        if cfg.optimizer_state == "travel" and opt_in:
            load_optimizer_arrays(optimizer, opt_in)
        cycle = int(meta.get("cycle", 0))
        metrics = site.train_visit(model, optimizer, visit, cycle)
        out = to_numpy(model.state_dict())
        metrics.update(received_digest=received, returned_digest=params_digest(out))
        if cfg.optimizer_state == "travel":
            out.update(optimizer_arrays(optimizer))
        self.log_info(fl_ctx, f"site {self.site} cycle {cycle} visit {int(meta.get('position', 0)) + 1}: {metrics['steps']} steps "
                              f"at lr {visit.lr:.3g}, train_loss {_fmt(metrics['train_loss'])}, time {metrics['seconds']:.1f}s")
        if self.writer is not None:
            self.writer.add_scalar("train_loss", float(metrics["train_loss"]), global_step=cycle)
        return FLModel(params_type=ParamsType.FULL, params=out, meta={"metrics": metrics})

