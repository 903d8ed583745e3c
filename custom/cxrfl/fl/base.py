"""The thin NVFlare layer every method shares: a controller that carries a server loop's messages,
and an executor that hands a site's tasks to the method's site host.

A method's server loop (:mod:`cxrfl.common.server`) and site host (:mod:`cxrfl.common.transport`)
never import NVFlare. :class:`TaskController` runs the loop with :meth:`TaskController.send` as its
transport (one non-blocking ``send_model`` per site, each with its own payload, then a wait while
tasks stand); :class:`TaskExecutor` finds and checks the site's data when the job starts (a bad
config fails this site at start with a clear message, never mid-round), answers each task through
the host, logs the host's one line per task and tracks its metrics (NVFlare's analytics sender:
TensorBoard or MLflow on the server).
"""

from __future__ import annotations

import abc
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
from nvflare.app_common.workflows.model_controller import ModelController

from cxrfl.common.resume import RESUME_ROOT
from cxrfl.common.server import RunAborted, RunStopped, ServerLoop
from cxrfl.common.transport import Message, SiteHost
from cxrfl.data.site import SiteData, load_site
from cxrfl.errors import CxrflError
from cxrfl.fl.site_config import resolve_site_config
from cxrfl.nn.models import select_device

STATE_ROOT = "cxrfl_state"
"""Folder under a site's workspace where site hosts keep state across rounds and resumed jobs."""


class TaskController(ModelController):
    """Runs a method's server loop over NVFlare.

    Args:
        task_timeout: seconds a site may take per task (0: no limit; a dead site's task still ends
            when NVFlare deems the site dead).
    """

    def __init__(self, task_timeout: int = 0) -> None:
        super().__init__(persistor_id="", ignore_result_error=True)
        if isinstance(task_timeout, bool) or not isinstance(task_timeout, int) or task_timeout < 0:
            raise ValueError(f"task_timeout must be an integer >= 0, got {task_timeout!r}")
        self.task_timeout = task_timeout

    @abc.abstractmethod
    def make_server(self, **common: Any) -> ServerLoop:
        """The method's server loop.

        Args:
            common: :class:`cxrfl.common.server.ServerLoop` arguments (transport, sites, folders, loggers).
        """

    def send(self, task: str, payloads: dict[str, Message]) -> dict[str, Message]:
        """One task per site, each with its own payload; the answers of the sites that succeeded.

        Sites that are not connected are left out at once (a warning), never waited for.

        Args:
            task: the task name.
            payloads: site -> (params, meta).
        """
        connected = {c.name for c in self.engine.get_clients()}
        results: dict[str, FLModel] = {}

        def collect(result: FLModel) -> bool:
            results[result.meta["client_name"]] = result
            return True

        for site, (params, meta) in payloads.items():
            if site not in connected:
                self.warning(f"site {site} is not connected; task {task} not sent")
                continue
            self.send_model(task_name=task, data=FLModel(params_type=ParamsType.FULL, params=dict(params), meta=dict(meta)),
                            targets=[site], callback=collect, timeout=self.task_timeout)
        while self.get_num_standing_tasks() > 0:
            if self.abort_signal.triggered:
                break
            time.sleep(0.2)
        return {s: (dict(r.params or {}), dict(r.meta or {})) for s, r in results.items()}

    def run(self) -> None:
        workspace = self.fl_ctx.get_engine().get_workspace()
        server = self.make_server(
            send=self.send, sites=self.sample_clients(), out_dir=self.get_app_dir(), run_id=self.fl_ctx.get_job_id(),
            resume_root=Path(workspace.get_root_dir()) / RESUME_ROOT, info=self.info, warning=self.warning,
            aborted=lambda: bool(self.abort_signal.triggered),
        )
        try:
            server.run()
        except RunAborted:
            self.info("aborted: nothing more is written")
        except RunStopped as exc:
            self.panic(str(exc))


class TaskExecutor(Executor):
    """Answers a method's tasks with this site's data.

    Args:
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``.
        num_workers: data-loader worker processes.
        num_threads: torch CPU threads (0: torch's default).
        analytic_sender_id: component id of NVFlare's analytics writer for metrics ("" for none).
    """

    def __init__(self, device: str = "auto", num_workers: int = 0, num_threads: int = 0,
                 analytic_sender_id: str = "analytic_sender") -> None:
        super().__init__()
        self.device_name = device
        self.num_workers = num_workers
        self.num_threads = num_threads
        self.analytic_sender_id = analytic_sender_id
        self.site = ""
        self.data: SiteData | None = None
        self.error: str | None = None
        self.state_root: Path | None = None
        self.writer = None
        self.host: SiteHost | None = None

    @abc.abstractmethod
    def make_host(self, data: SiteData, device: torch.device, state_root: Path) -> SiteHost:
        """The method's site host over this site's data.

        Args:
            data: the site's checked data.
            device: torch device.
            state_root: folder for state kept across tasks and jobs.
        """

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            self._start(fl_ctx)

    def _start(self, fl_ctx: FLContext) -> None:
        self.site = fl_ctx.get_identity_name()
        engine = fl_ctx.get_engine()
        workspace = engine.get_workspace()
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
        self.log_info(fl_ctx, f"site {self.site}: {len(self.data.table)} images ({splits}), {len(self.data.classes)} "
                              f"classes, {len(self.data.skipped)} skipped, loaded in {time.perf_counter() - start:.1f}s")
        if splits["train"] == 0 or splits["val"] == 0:
            self.error = f"site {self.site}: empty train or val split {splits}; add images or change split fractions"
            self.log_error(fl_ctx, self.error)

    def _host(self) -> SiteHost:
        if self.host is None:
            self.host = self.make_host(self.data, select_device(self.device_name), self.state_root)
        return self.host

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        if self.error:
            self.log_error(fl_ctx, f"site {self.site}: refusing task {task_name}: {self.error}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        try:
            host = self._host()
            if task_name not in host.tasks:
                self.log_error(fl_ctx, f"site {self.site}: unknown task {task_name!r}")
                return make_reply(ReturnCode.TASK_UNKNOWN)
            incoming = FLModelUtils.from_shareable(shareable)
            meta = dict(incoming.meta or {})
            if abort_signal.triggered:
                return make_reply(ReturnCode.TASK_ABORTED)
            params, answer = host.handle(task_name, incoming.params or {}, meta)
            line = host.describe(task_name, meta, answer)
            if line:
                self.log_info(fl_ctx, line)
            self._track(host, task_name, answer)
        except Exception as exc:  # one bad round at one site must not take the federation down
            self.log_exception(fl_ctx, f"site {self.site}: task {task_name} failed: {exc}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        return FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=params, meta=answer))

    def _track(self, host: SiteHost, task: str, answer: dict[str, Any]) -> None:
        if self.writer is None:
            return
        tracked = host.scalars(task, answer)
        if tracked:
            values, step = tracked
            for key, value in values.items():
                if value is not None:
                    self.writer.add_scalar(key, float(value), global_step=int(step))
