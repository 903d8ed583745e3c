"""NVFlare glue of cyclical weight transfer: the relay controller and the site executor.

The relay itself (counts, plan, cycles, skipped sites, retried cycles, validation, early
stopping, checkpoints, resume, evaluation) is :class:`cxrfl.cwt.server.CWTServer`, the loop the
benchmark and the tests run too; this module only carries its messages over NVFlare
(:class:`cxrfl.fl.base.TaskController`) and hands each site's tasks to
:class:`cxrfl.cwt.host.CWTSiteHost` (:class:`cxrfl.fl.base.TaskExecutor`). Outputs: see
:mod:`cxrfl.cwt.server`.

Resuming: submit the job again with ``resume_from`` set to the interrupted job's id (its state is
in ``<server workspace>/cxrfl_resume/<job id>``; a folder is never accepted); the relay goes on
from the cycle after the interrupted run's last completed one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cxrfl.common.server import ServerLoop
from cxrfl.common.transport import SiteHost
from cxrfl.cwt.config import CWTConfig, RelayConfig
from cxrfl.cwt.host import CWTSiteHost
from cxrfl.cwt.server import CWTServer
from cxrfl.data.site import SiteData
from cxrfl.fl.base import Scalars, TaskController, TaskExecutor
from cxrfl.nn.models import ModelConfig

_RELAY = RelayConfig()


class CyclicWeightTransfer(TaskController):
    """Cyclical weight transfer with the four optimizations of Balachandar et al. (2020).

    Args:
        cwt_config: :class:`cxrfl.cwt.config.CWTConfig` fields (task, cycles, order, PLTI, CLR,
            LWMS, CWL, learning rate and its decay, weight decay, batch size, patience ...; sent
            to the sites).
        model_config: :class:`cxrfl.nn.models.ModelConfig` fields (``pretrained`` is read here,
            on the server, for the initial weights only).
        site_order: the fixed relay order (sites not listed follow in name order); None: by name.
        min_sites: fewest sites that must answer the counts task, and train in a cycle for it
            to count (:class:`cxrfl.cwt.config.RelayConfig`).
        min_sites_timeout: seconds of failed attempts before the job stops with the reason.
        retry_pause: seconds between two attempts.
        task_timeout: seconds a site may take per task (0: no limit). A site that is down when
            its turn comes is skipped after this long, so set it in deployments.
        evaluate_test: evaluate the best model on every site's test split at the end.
        pooled: how that evaluation counts at the sites and pools
            (:class:`cxrfl.clinical.pooling.PooledEvaluation` fields; None: defaults).
        resume_from: continue an interrupted run of this job: its job id on this server.
        analytic_sender_id: the server's analytics writer for the pooled validation loss per
            cycle (:meth:`record_scalars`; "": none).
    """

    def __init__(
        self,
        *,
        cwt_config: dict | None = None,
        model_config: dict | None = None,
        site_order: list[str] | None = _RELAY.site_order,
        min_sites: int = _RELAY.min_sites,
        min_sites_timeout: float = _RELAY.min_sites_timeout,
        retry_pause: float = _RELAY.retry_pause,
        task_timeout: int = 0,
        evaluate_test: bool = _RELAY.evaluate_test,
        pooled: dict | None = None,
        resume_from: str | None = None,
        analytic_sender_id: str = "analytic_sender",
    ) -> None:
        super().__init__(task_timeout=task_timeout, analytic_sender_id=analytic_sender_id)
        self.config = CWTConfig.from_dict(cwt_config)
        self.network = ModelConfig.from_dict(model_config or {})
        self.relay = RelayConfig.from_dict(
            {
                "site_order": site_order,
                "min_sites": min_sites,
                "min_sites_timeout": min_sites_timeout,
                "retry_pause": retry_pause,
                "evaluate_test": evaluate_test,
                "pooled": pooled,
            },
            where="the CWT controller's arguments",
        )
        self.resume_from = resume_from

    def make_server(self, **common: Any) -> ServerLoop:
        return CWTServer(
            config=self.config, model_config=self.network, relay=self.relay, resume_from=self.resume_from, **common
        )

    def record_scalars(self, name: str, record: Mapping[str, Any]) -> Scalars | None:
        """Per completed cycle: the validation loss pooled over the sites, and the sites trained."""
        if name != "cycles.jsonl" or record.get("status") != "completed":
            return None
        values = {"val_loss": record.get("val_loss"), "sites_trained": float(len(record.get("trained") or ()))}
        return values, int(record["cycle"])


class CWTExecutor(TaskExecutor):
    """A site of the relay: answers ``counts``, ``train`` (its turn) and ``validate`` with its own data.

    Finds and checks the site's data like every cxrfl executor (:class:`cxrfl.fl.base.TaskExecutor`);
    the task settings come from the server.
    """

    def make_host(self, data: SiteData, device: torch.device, state_root: Path) -> SiteHost:
        return CWTSiteHost(data, device=device, num_workers=self.num_workers)
