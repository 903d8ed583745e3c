"""Site executor: runs a :class:`cxrfl.surgical.learner.SiteLearner` for NVFlare tasks.

Nothing about the site's data is in the job: the executor finds the site's own config at run
time (see :func:`resolve_site_config`), loads and validates the data when the job starts (a
bad config fails this site at start with a clear message, never mid-round), and answers
``train`` (head warm-up or one federated round, chosen by ``meta["phase"]``) and ``validate``
(cross-site evaluation on a split) tasks. What a site keeps between rounds (optimizer state,
local BatchNorm or head) lives in ``<site workspace>/cxrfl_state/<run key>``, so a run resumed
by a new job (see :class:`cxrfl.fl.controller.SurgicalAggregation`) finds it again; the state
of the last few runs is kept. The model and training settings, and the head mode
(``surgical``, ``union`` with the class list of the received head, or ``local``; see
:mod:`cxrfl.surgical.head_modes`), arrive in the task metadata from the server, so there is one source
of truth per job.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from cxrfl.data.site import SiteData, load_site
from cxrfl.errors import CxrflError
from cxrfl.fl.site_config import LOCAL_CONFIG_NAME, resolve_site_config  # noqa: F401 (LOCAL_CONFIG_NAME: old import path)
from cxrfl.nn.models import ModelConfig, select_device
from cxrfl.surgical.learner import SiteLearner
from cxrfl.nn.training import TrainConfig

STATE_ROOT = "cxrfl_state"
KEEP_STATES = 3  # runs whose site state (optimizer, local BatchNorm or head) stays on disk


class SiteExecutor(Executor):
    """Answers ``train`` and ``validate`` tasks with this site's data.

    Args:
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``.
        num_workers: data-loader worker processes.
        num_threads: torch CPU threads (0: torch's default).
        analytic_sender_id: component id of an NVFlare ``TBWriter`` for metrics ("" for none).
    """

    def __init__(
        self,
        device: str = "auto",
        num_workers: int = 0,
        num_threads: int = 0,
        analytic_sender_id: str = "analytic_sender",
    ) -> None:
        super().__init__()
        self.device_name = device
        self.num_workers = num_workers
        self.num_threads = num_threads
        self.analytic_sender_id = analytic_sender_id
        self.site = ""
        self.data: SiteData | None = None
        self.error: str | None = None
        self.learner: SiteLearner | None = None
        self._learner_key: tuple | None = None
        self.job_id = ""
        self.state_root: Path | None = None
        self.writer = None

    # ------------------------------------------------------------- lifecycle
    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            self._start(fl_ctx)

    def _start(self, fl_ctx: FLContext) -> None:
        self.site = fl_ctx.get_identity_name()
        engine = fl_ctx.get_engine()
        workspace = engine.get_workspace()
        self.job_id = fl_ctx.get_job_id()
        self.state_root = Path(workspace.get_root_dir()) / STATE_ROOT
        if self.num_threads > 0:
            torch.set_num_threads(self.num_threads)
        if self.analytic_sender_id:
            self.writer = engine.get_component(self.analytic_sender_id)
        try:
            path, how = resolve_site_config(self.site, workspace.get_site_config_dir())
            self.log_info(fl_ctx, f"site {self.site}: reading site config {path} (from {how})")
            start = time.perf_counter()
            self.data = load_site(path, check_images=True)
        except CxrflError as exc:
            self.error = str(exc)
            self.log_error(fl_ctx, f"site {self.site} cannot take part: {exc}")
            return
        for problem in self.data.problems:
            self.log_warning(fl_ctx, f"site {self.site}: {problem}")
        for path, reason in self.data.skipped[:10]:
            self.log_warning(fl_ctx, f"site {self.site}: skipped image {path}: {reason}")
        splits = {s: len(self.data.split_table(s)) for s in ("train", "val", "test")}
        self.log_info(
            fl_ctx,
            f"site {self.site}: {len(self.data.table)} images ({splits}), {len(self.data.classes)} classes, "
            f"{len(self.data.skipped)} skipped, loaded in {time.perf_counter() - start:.1f}s",
        )
        if splits["train"] == 0 or splits["val"] == 0:
            self.error = f"site {self.site}: empty train or val split {splits}; add images or change split fractions"
            self.log_error(fl_ctx, self.error)

    def _get_learner(self, meta: dict[str, Any]) -> SiteLearner:
        model_cfg = ModelConfig.from_dict(meta.get("model_config") or {})
        train_cfg = TrainConfig.from_dict(meta.get("train_config") or {})
        batchnorm = str(meta.get("batchnorm", "fedavg"))
        head_mode = str(meta.get("head_mode", "surgical"))
        missing = str(meta.get("missing", "negative"))
        run_key = str(meta.get("run_key") or self.job_id)
        key = (model_cfg, train_cfg, batchnorm, head_mode, missing, run_key)
        if self.learner is None or key != self._learner_key:
            state_dir = self.state_root / run_key
            if not state_dir.is_dir():
                _prune_states(self.state_root, KEEP_STATES - 1)
            self.learner = SiteLearner(
                self.data,
                state_dir,
                model_config=model_cfg,
                train_config=train_cfg,
                batchnorm=batchnorm,
                device=select_device(self.device_name),
                num_workers=self.num_workers,
                head_mode=head_mode,
                missing=missing,
            )
            self._learner_key = key
        return self.learner

    # ----------------------------------------------------------------- tasks
    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        if self.error:
            self.log_error(fl_ctx, f"site {self.site}: refusing task {task_name}: {self.error}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        try:
            incoming = FLModelUtils.from_shareable(shareable)
            meta = dict(incoming.meta or {})
            learner = self._get_learner(meta)
            round_num = int(meta.get("round", incoming.current_round or 0))
            if abort_signal.triggered:
                return make_reply(ReturnCode.TASK_ABORTED)
            if task_name == "train":
                if meta.get("phase") == "warmup":
                    update = learner.warmup(incoming.params or {})
                else:
                    update = learner.train_round(incoming.params or {}, round_num, classes=meta.get("classes"))
                self._log_round(fl_ctx, round_num, update.metrics)
                out = FLModel(
                    params_type=ParamsType.FULL,
                    params=update.params,
                    meta={"classes": update.classes, "num_samples": update.num_samples, "metrics": update.metrics},
                )
            elif task_name == "validate":
                split = str(meta.get("split", "test"))
                metrics = learner.evaluate_params(incoming.params or {}, split, classes=meta.get("classes"))
                self.log_info(fl_ctx, f"site {self.site} {split}: loss {metrics['loss']:.4f} mean AUROC {_fmt(metrics['mean_auroc'])}")
                out = FLModel(params_type=ParamsType.FULL, params={}, meta={"classes": learner.classes, "metrics": metrics})
            else:
                self.log_error(fl_ctx, f"site {self.site}: unknown task {task_name!r}")
                return make_reply(ReturnCode.TASK_UNKNOWN)
        except Exception as exc:  # one bad round at one site must not take the federation down
            self.log_exception(fl_ctx, f"site {self.site}: task {task_name} failed: {exc}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        return FLModelUtils.to_shareable(out)

    def _log_round(self, fl_ctx: FLContext, round_num: int, m: dict[str, Any]) -> None:
        self.log_info(
            fl_ctx,
            f"site {self.site} {m['phase']} round {round_num}: train_loss {_fmt(m.get('train_loss'))} "
            f"val_loss {_fmt(m.get('val_loss'))} val_AUROC {_fmt(m.get('val_mean_auroc'))} time {m['seconds']:.1f}s",
        )
        if self.writer is not None:
            for key in ("train_loss", "val_loss", "val_mean_auroc"):
                if m.get(key) is not None:
                    self.writer.add_scalar(key, float(m[key]), global_step=round_num)


def _prune_states(root: Path, keep: int) -> None:
    """Remove all but the ``keep`` most recently used run states under ``root``."""
    if not root.is_dir():
        return
    runs = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in runs[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"
