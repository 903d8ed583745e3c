"""NVFlare glue of FedFew: one server workflow for the three stages, and the site executor.

The workflow is :class:`cxrfl.fedfew.server.FedFewServer` (stage planning, FedAvg, margins,
threshold, prototypes, resumable stage results, the final self-describing model); this module
only carries its messages over NVFlare: one ``send_model`` per site and task (each site gets its
own payload: its own UCs only), then a wait on ``get_num_standing_tasks``. A site whose task
fails or times out is left out of that task with a warning; the run stops (``panic``) only
when nothing is left to go on with, with the reason.

Tasks: see :mod:`cxrfl.fedfew.protocol`. Written to the server's app folder: see
:mod:`cxrfl.fedfew.server` (``fedfew/stage*``, ``FL_global_model.pt``, ``cxrfl/*.jsonl|json``).

Resuming a stopped run: submit the job again with ``resume`` set to the earlier run's
``.../app_server/fedfew`` folder (absolute path, or relative to the new app folder); finished
stages are loaded, not run again.
"""

from __future__ import annotations

import time
from typing import Any

from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.app_common.workflows.model_controller import ModelController

from cxrfl.fedfew import protocol as P
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.protocol import Message, SiteHost
from cxrfl.fedfew.server import FedFewAborted, FedFewServer, FedFewStop
from cxrfl.fl.executor import SiteExecutor, _fmt
from cxrfl.nn.models import ModelConfig, select_device


class FedFew(ModelController):
    """The FedFew workflow: self-supervised pretraining, energy-based CC training, threshold and prototypes.

    Args:
        fedfew_config: :class:`cxrfl.fedfew.config.FedFewConfig` fields (sent to the sites).
        model_config: :class:`cxrfl.nn.models.ModelConfig` fields (``pretrained`` is read here, on
            the server, for the initial encoder only).
        min_clients: fewest valid site results that make a round; fewer keep the previous weights.
        task_timeout: seconds a site may take per task (0: no limit).
        resume: folder of an earlier run's stage results (``.../app_server/fedfew``) whose
            finished stages are loaded instead of run; None: run every stage.
        evaluate_test: evaluate the final model on every site's test split.
    """

    def __init__(self, *, fedfew_config: dict | None = None, model_config: dict | None = None, min_clients: int = 1,
                 task_timeout: int = 0, resume: str | None = None, evaluate_test: bool = True) -> None:
        super().__init__(persistor_id="", ignore_result_error=True)
        if isinstance(min_clients, bool) or not isinstance(min_clients, int) or min_clients < 1:
            raise ValueError(f"min_clients must be an integer >= 1, got {min_clients!r}")
        if isinstance(task_timeout, bool) or not isinstance(task_timeout, int) or task_timeout < 0:
            raise ValueError(f"task_timeout must be an integer >= 0, got {task_timeout!r}")
        self.config = FedFewConfig.from_dict(fedfew_config)
        self.model_config = ModelConfig.from_dict(model_config or {})
        self.min_clients = min_clients
        self.task_timeout = task_timeout
        self.resume = resume
        self.evaluate_test = evaluate_test

    def _send(self, task: str, payloads: dict[str, Message]) -> dict[str, Message]:
        """One task per site (each its own payload); the answers of the sites that succeeded."""
        results: dict[str, FLModel] = {}

        def collect(result: FLModel) -> bool:
            results[result.meta["client_name"]] = result
            return True

        for site, (params, meta) in payloads.items():
            self.send_model(task_name=task, data=FLModel(params_type=ParamsType.FULL, params=params, meta=meta),
                            targets=[site], callback=collect, timeout=self.task_timeout)
        while self.get_num_standing_tasks() > 0:
            if self.abort_signal.triggered:
                break
            time.sleep(0.2)
        return {s: (dict(r.params or {}), dict(r.meta or {})) for s, r in results.items()}

    def run(self) -> None:
        sites = self.sample_clients()
        self.info(f"FedFew: {len(sites)} site(s), {self.config.ssl_rounds} self-supervised round(s), "
                  f"{self.config.warmup_rounds}+{self.config.rounds} classifier round(s), resume={self.resume}")
        server = FedFewServer(
            self._send, sites=sites, config=self.config, model_config=self.model_config, out_dir=self.get_app_dir(),
            min_clients=self.min_clients, resume=self.resume, evaluate_test=self.evaluate_test,
            info=self.info, warning=self.warning, aborted=lambda: bool(self.abort_signal.triggered),
        )
        try:
            server.run()
        except FedFewAborted:
            self.info("FedFew: aborted")
        except FedFewStop as exc:
            self.panic(f"FedFew stopped: {exc}")


class FedFewExecutor(SiteExecutor):
    """A FedFew site: answers the tasks of :data:`cxrfl.fedfew.protocol.TASKS` with its own data.

    Finds and checks the site's data like :class:`cxrfl.fl.executor.SiteExecutor` (same config
    resolution, start-up checks and arguments); the settings of every task come from the server.
    """

    def __init__(self, device: str = "auto", num_workers: int = 0, num_threads: int = 0,
                 analytic_sender_id: str = "analytic_sender") -> None:
        super().__init__(device=device, num_workers=num_workers, num_threads=num_threads, analytic_sender_id=analytic_sender_id)
        self.host: SiteHost | None = None

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        if self.error:
            self.log_error(fl_ctx, f"site {self.site}: refusing task {task_name}: {self.error}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        if task_name not in P.TASKS:
            self.log_error(fl_ctx, f"site {self.site}: unknown task {task_name!r}")
            return make_reply(ReturnCode.TASK_UNKNOWN)
        try:
            incoming = FLModelUtils.from_shareable(shareable)
            meta = dict(incoming.meta or {})
            if self.host is None:
                self.host = SiteHost(self.data, select_device(self.device_name), self.num_workers)
            if abort_signal.triggered:
                return make_reply(ReturnCode.TASK_ABORTED)
            params, out_meta = self.host.handle(task_name, incoming.params or {}, meta)
            self._log_task(fl_ctx, task_name, meta, out_meta)
        except Exception as exc:  # one failing site must not take the federation down
            self.log_exception(fl_ctx, f"site {self.site}: task {task_name} failed: {exc}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        return FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=params, meta=out_meta))

    def _log_task(self, fl_ctx: FLContext, task: str, meta: dict[str, Any], out: dict[str, Any]) -> None:
        """One log line per task (a round of a stage, a statistics pass, the prototypes)."""
        m = out.get("metrics") or {}
        if task == P.INFO:
            info = out["info"]
            self.log_info(fl_ctx, f"site {self.site}: {len(info['classes'])} class(es), {info['n_labelled']} labelled "
                                  f"training image(s), {info['n_ssl']} image(s) for self-supervised learning")
        elif task == P.SSL:
            self.log_info(fl_ctx, f"site {self.site} stage 1 round {m.get('round')}: SimSiam loss {_fmt(m.get('ssl_loss'))}, "
                                  f"{m.get('steps')} steps, time {m.get('seconds', 0):.1f}s")
            self._scalar("ssl_loss", m.get("ssl_loss"), m.get("round"))
        elif task == P.TRAIN:
            self.log_info(fl_ctx, f"site {self.site} stage 2 round {m.get('round')} (lambda {m.get('energy_weight')}): "
                                  f"train_loss {_fmt(m.get('train_loss'))} bce {_fmt(m.get('train_bce'))} "
                                  f"hinge_in {_fmt(m.get('train_hinge_in'))} hinge_out {_fmt(m.get('train_hinge_out'))}, "
                                  f"{m.get('steps')} steps, time {m.get('seconds', 0):.1f}s")
            self._scalar("train_loss", m.get("train_loss"), m.get("round"))
        elif task == P.ENERGY:
            s = out.get("stats") or {}
            self.log_info(fl_ctx, f"site {self.site}: energy statistics ({meta.get('mode')}) over {s.get('n_in')} image(s) "
                                  f"without and {s.get('n_out')} with a UC")
        elif task == P.PROTOTYPES:
            sent = [p["uc"] for p in out.get("prototypes") or []]
            self.log_info(fl_ctx, f"site {self.site}: sent the prototypes of {sent or 'no class'}")
            for reason in (out.get("refused") or {}).values():
                self.log_warning(fl_ctx, reason)
        elif task == P.VALIDATE:
            parts = [f"CC mean AUROC {_fmt(m.get('cc_mean_auroc'))}"] + [
                f"{uc} F1 {u['f1']:.3f}" for uc, u in (m.get("uc") or {}).items()]
            self.log_info(fl_ctx, f"site {self.site} {m.get('split')}: {'; '.join(parts)}")

    def _scalar(self, name: str, value: float | None, step: int | None) -> None:
        if self.writer is not None and value is not None:
            self.writer.add_scalar(name, float(value), global_step=int(step or 0))
