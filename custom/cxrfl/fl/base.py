"""The thin NVFlare layer every method shares: a controller that carries a server loop's messages,
and an executor that hands a site's tasks to the method's site host.

A method's server loop (:mod:`cxrfl.common.server`) and site host (:mod:`cxrfl.common.transport`)
never import NVFlare. :class:`TaskController` runs the loop with :meth:`TaskController.send` as its
transport (one non-blocking ``send_model`` per site, each with its own payload, then a wait while
tasks stand); :class:`TaskExecutor` finds and checks the site's data when the job starts (a bad
config fails this site at start with a clear message, never mid-round), answers each task through
the host, logs the host's one line per task and tracks its metrics (NVFlare's analytics sender:
TensorBoard or MLflow on the server); the controller tracks the run's aggregated metrics the same
way (:meth:`TaskController.record_scalars`). :func:`write_every_arg` makes NVFlare's job exporter
(recipes) write every argument of a component.
"""

from __future__ import annotations

import abc
import inspect
import json
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from nvflare.apis.client import Client
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.app_common.workflows.model_controller import ModelController
from nvflare.fuel.utils.memory_utils import cleanup_memory

from cxrfl.common.resume import RESUME_ROOT, RESUME_ROOT_ENV
from cxrfl.common.server import RunAborted, ServerLoop
from cxrfl.common.transport import Message, OnAnswer, SiteHost
from cxrfl.data.cache import IMAGE_CACHE
from cxrfl.data.dataset import resolve_workers
from cxrfl.data.site import SiteData, load_site, training_refusal
from cxrfl.errors import CxrflError
from cxrfl.fl.site_config import resolve_site_config
from cxrfl.nn.models import select_device
from cxrfl.nn.threads import use_cores

STATE_ROOT = "cxrfl_state"
"""Folder under a site's workspace where site hosts keep state across rounds and resumed jobs."""

Scalars = tuple[dict[str, float], int]
"""Metrics to track (name -> value) and their step (round, cycle)."""

CLASS_NAME_ROLES = ("project_admin", "lead")
"""Roles whose jobs may send class names beyond a site's own to every site (union head, CWT,
FedFew, cxrfl's aggregator in NVFlare's own workflows). An org admin operates one hospital's site
and reads what it receives, so the server refuses such a job from any other role (docs/security.md)."""


def submitter_role(fl_ctx: FLContext) -> str | None:
    """The role of the job's submitter, as NVFlare recorded it in the job's ``meta.json`` on this party.

    Args:
        fl_ctx: the job's context (engine and job id).

    Returns:
        the role; None where no submitter is recorded (simulator, in-process runs).
    """
    engine = fl_ctx.get_engine()
    path = Path(engine.get_workspace().get_job_meta_path(fl_ctx.get_job_id())) if engine is not None else None
    if path is None or not path.is_file():
        return None
    from nvflare.apis.job_def import JobMetaKey

    return json.loads(path.read_text()).get(JobMetaKey.SUBMITTER_ROLE.value)


def class_names_refusal(fl_ctx: FLContext, what: str) -> str | None:
    """Why a job that sends class names beyond a site's own to every site may not run (None: it may).

    Args:
        fl_ctx: the job's context.
        what: the component and mode, for the message.
    """
    role = submitter_role(fl_ctx)
    if role is None or role in CLASS_NAME_ROLES:
        return None
    return (
        f"{what} sends every site class names other sites hold, and this job was submitted by role {role!r}; "
        f"only {' or '.join(CLASS_NAME_ROLES)} may submit it. Submit it as the lead, or use head_mode "
        f"surgical or local (docs/security.md)"
    )


def write_every_arg(component: Any, args: Mapping[str, Any] | None = None) -> Any:
    """Make NVFlare's job exporter (``FedJob.export_job``, recipes) write every argument of ``component``.

    The exporter writes a constructor argument only when it differs from its default, reading its
    value from the attribute of the same name (or ``_name``); a later change of a default would then
    silently change exported jobs. This lists the arguments in ``_always_serialize_args`` (NVFlare
    2.9) and keeps ``args`` as ``_<name>`` attributes for components that hold them in another form.

    Args:
        component: an NVFlare component (controller, executor, filter, widget).
        args: argument -> its JSON value; None: every constructor argument the component keeps
            under its own name.

    Returns:
        the component.

    Raises:
        ValueError: an attribute named like an argument holds another value (the exporter would
            write that one).
    """
    if args is None:
        params = inspect.signature(type(component).__init__).parameters
        args = {p: component.__dict__[p] for p in params if p in component.__dict__}
    for name, value in args.items():
        if name in component.__dict__ and component.__dict__[name] != value:
            raise ValueError(
                f"{type(component).__name__}.{name} does not hold its argument; the job would carry "
                f"{component.__dict__[name]!r} instead of {value!r}"
            )
        component.__dict__[f"_{name}"] = value
    component._always_serialize_args = tuple(args)
    return component


def mean_over_sites(
    site_metrics: Mapping[str, Mapping[str, Any] | None], names: Sequence[str], per_class: str | None = None
) -> dict[str, float]:
    """Each metric's mean over the sites that report a finite value (missing: left out).

    Args:
        site_metrics: site -> its metrics (as its answer's ``metrics``).
        names: the metrics to average.
        per_class: a metric holding class -> value (e.g. per-class AUROC): its mean per class over
            the sites that have the class, as ``<per_class>/<class>``.
    """
    values: dict[str, list[float]] = {}
    for metrics in site_metrics.values():
        metrics = metrics or {}
        flat = {n: metrics.get(n) for n in names}
        flat.update({f"{per_class}/{c}": v for c, v in (metrics.get(per_class) or {}).items()} if per_class else {})
        for key, value in flat.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    return {key: sum(v) / len(v) for key, v in values.items()}


def track(writer: Any, scalars: Scalars | None) -> None:
    """Send metrics to NVFlare's analytics writer (its receivers: TensorBoard, MLflow).

    Args:
        writer: a ``TBWriter`` (None: tracking is off).
        scalars: the metrics and their step (None or missing values: nothing).
    """
    if writer is None or not scalars:
        return
    values, step = scalars
    for key, value in values.items():
        if value is not None:
            writer.add_scalar(key, float(value), global_step=int(step))


class TaskController(ModelController):
    """Runs a method's server loop over NVFlare.

    Args:
        task_timeout: seconds a site may take per task (0: no limit; a dead site's task still ends
            when NVFlare deems the site dead).
        analytic_sender_id: component id of the server's NVFlare analytics writer for the run's
            aggregated metrics (:meth:`record_scalars`); "" or a missing component: not tracked.
    """

    def __init__(self, task_timeout: int = 0, analytic_sender_id: str = "analytic_sender") -> None:
        super().__init__(persistor_id="", ignore_result_error=True)
        if isinstance(task_timeout, bool) or not isinstance(task_timeout, int) or task_timeout < 0:
            raise ValueError(f"task_timeout must be an integer >= 0, got {task_timeout!r}")
        self.task_timeout = task_timeout
        self.analytic_sender_id = analytic_sender_id
        self.writer = None

    def process_result_of_unknown_task(
        self, client: Client, task_name: str, client_task_id: str, result: Shareable, fl_ctx: FLContext
    ) -> None:
        """Drop an answer whose task has ended (a site that was silent past ``task_timeout``, then came back).

        NVFlare's ModelController would hand a late ``train`` result on as the context's training
        result ("sent to aggregator"); a cxrfl round was aggregated without it, so it is only logged.

        Args:
            client: the site.
            task_name: the task it answers.
            client_task_id: NVFlare's id of the ended task.
            result: the answer (not read).
            fl_ctx: NVFlare's context.
        """
        self.fl_ctx = fl_ctx
        self.warning(
            f"late answer from site {client.name} to task {task_name} dropped: the task had ended without it "
            "(the round was aggregated from the sites that answered in time)"
        )

    @property
    def discloses_class_names(self) -> bool:
        """Whether this workflow sends a site class names beyond its own (only :data:`CLASS_NAME_ROLES` may run it)."""
        return True

    @abc.abstractmethod
    def make_server(self, **common: Any) -> ServerLoop:
        """The method's server loop.

        Args:
            common: :class:`cxrfl.common.server.ServerLoop` arguments (transport, sites, folders, loggers).
        """

    def record_scalars(self, name: str, record: Mapping[str, Any]) -> Scalars | None:
        """The aggregated metrics a run record carries, for experiment tracking (None: none).

        Args:
            name: the record file (``rounds.jsonl``, ``cycles.jsonl`` ...).
            record: the record (see the method's server loop).
        """
        return None

    def send(self, task: str, payloads: dict[str, Message], *, on_answer: OnAnswer | None = None) -> dict[str, Message]:
        """One task per site, each with its own payload; the answers of the sites that succeeded.

        Sites that are not connected are left out at once (a warning), never waited for. Each
        answer is taken out of NVFlare's result as it arrives (handed to ``on_answer`` and its
        params dropped when given); after the task NVFlare's ``cleanup_memory`` (gc +
        ``malloc_trim``) returns the round's freed transfer buffers to the system.

        Args:
            task: the task name.
            payloads: site -> (params, meta).
            on_answer: see :class:`cxrfl.common.transport.Send`.
        """
        connected = {c.name for c in self.engine.get_clients()}
        answers: dict[str, Message] = {}
        lock = threading.Lock()

        def collect(result: FLModel) -> bool:
            params, meta = dict(result.params or {}), dict(result.meta or {})
            result.params = None
            with lock:
                if on_answer is not None:
                    on_answer(meta["client_name"], (params, meta))
                    params = {}
                answers[meta["client_name"]] = (params, meta)
            return True

        for site, (params, meta) in payloads.items():
            if site not in connected:
                self.warning(f"site {site} is not connected; task {task} not sent")
                continue
            self.send_model(
                task_name=task,
                data=FLModel(params_type=ParamsType.FULL, params=dict(params), meta=dict(meta)),
                targets=[site],
                callback=collect,
                timeout=self.task_timeout,
            )
        while self.get_num_standing_tasks() > 0:
            if self.abort_signal.triggered:
                break
            time.sleep(0.2)
        cleanup_memory()
        return answers

    def run(self) -> None:
        refusal = class_names_refusal(self.fl_ctx, type(self).__name__) if self.discloses_class_names else None
        if refusal:
            self.panic(refusal)
            return
        engine = self.fl_ctx.get_engine()
        workspace = engine.get_workspace()
        resume_root = os.environ.get(RESUME_ROOT_ENV) or Path(workspace.get_root_dir()) / RESUME_ROOT
        try:
            server = self.make_server(
                send=self.send,
                sites=self.sample_clients(),
                out_dir=self.get_app_dir(),
                run_id=self.fl_ctx.get_job_id(),
                resume_root=resume_root,
                info=self.info,
                warning=self.warning,
                aborted=lambda: bool(self.abort_signal.triggered),
            )
            self.writer = engine.get_component(self.analytic_sender_id) if self.analytic_sender_id else None
            if self.writer is not None:
                # a server job fires no ABOUT_TO_START_RUN: start NVFlare's writer as a site's would be started
                self.writer.handle_event(EventType.ABOUT_TO_START_RUN, self.fl_ctx)
                server.on_record = lambda name, record: track(self.writer, self.record_scalars(name, record))
            server.run()
        except RunAborted:
            self.info("aborted: nothing more is written")
        except CxrflError as exc:  # stopped, a bad resume_from, an unreadable state, a full disk: one line
            self.panic(str(exc))


class TaskExecutor(Executor):
    """Answers a method's tasks with this site's data.

    Args:
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``.
        num_workers: data-loader worker processes per loader, or ``auto`` (one per core this process
            is given, less one, at most 8: :func:`cxrfl.data.dataset.resolve_workers`).
        num_threads: CPU threads of torch and BLAS (0: every core this process is given:
            ``OMP_NUM_THREADS``, else its CPU affinity and cgroup quota). Sites sharing a machine
            (simulator) each take their share, e.g. cores / ``-t``.
        analytic_sender_id: component id of NVFlare's analytics writer for metrics ("" for none).
    """

    def __init__(
        self,
        device: str = "auto",
        num_workers: int | str = "auto",
        num_threads: int = 0,
        analytic_sender_id: str = "analytic_sender",
    ) -> None:
        super().__init__()
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
            raise ValueError(f"num_threads must be an integer >= 0 (0: all cores given), got {num_threads!r}")
        self.device_name = device
        resolve_workers(num_workers)  # a bad value fails the job at the site's start, with its name
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
        threads = use_cores(self.num_threads)
        self.log_info(fl_ctx, f"site {self.site}: {threads} CPU thread(s) (num_threads={self.num_threads})")
        if self.analytic_sender_id:
            self.writer = engine.get_component(self.analytic_sender_id)
        try:
            simulator = bool(fl_ctx.get_prop(FLContextKey.SIMULATE_MODE, False))
            path, how = resolve_site_config(self.site, workspace.get_site_config_dir(), simulator=simulator)
            self.log_info(fl_ctx, f"site {self.site}: reading site config {path} (from {how})")
            start = time.perf_counter()
            self.data = load_site(path, check_images=True)
            self.data.cache_dir = self.state_root / IMAGE_CACHE
        except CxrflError as exc:
            self.error = str(exc)
            self.log_error(fl_ctx, f"site {self.site} cannot take part: {exc}")
            return
        for problem in self.data.problems:
            self.log_warning(fl_ctx, f"site {self.site}: {problem}")
        for path, reason in self.data.skipped[:10]:
            self.log_warning(fl_ctx, f"site {self.site}: skipped image {path}: {reason}")
        splits = self.data.split_sizes()
        self.log_info(
            fl_ctx,
            f"site {self.site}: {len(self.data.table)} images ({splits}), {len(self.data.classes)} "
            f"classes, {len(self.data.skipped)} skipped, loaded in {time.perf_counter() - start:.1f}s",
        )
        self.log_info(
            fl_ctx,
            f"site {self.site}: {resolve_workers(self.num_workers)} loader worker(s) per loader "
            f"(num_workers={self.num_workers}); preprocessed images cached in {self.data.cache_dir}",
        )
        self.error = training_refusal(self.data)
        if self.error:
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
        except CxrflError as exc:  # a refused setting, an unreadable state, a full disk: one line, no traceback
            self.log_error(fl_ctx, f"site {self.site}: task {task_name} failed: {exc}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        except Exception as exc:  # one bad round at one site must not take the federation down
            self.log_exception(fl_ctx, f"site {self.site}: task {task_name} failed: {exc}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        return FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=params, meta=answer))

    def _track(self, host: SiteHost, task: str, answer: dict[str, Any]) -> None:
        if self.writer is not None:
            track(self.writer, host.scalars(task, answer))
