"""NVFlare glue of FedFew: the three-stage workflow as a job, and the site executor.

The workflow is :class:`cxrfl.fedfew.server.FedFewServer` (stage planning, FedAvg, margins,
threshold, prototypes, resumable stage results, the final self-describing model), run by
:class:`cxrfl.fl.base.TaskController` over NVFlare; a site answers through
:class:`cxrfl.fedfew.protocol.FedFewSiteHost`, run by :class:`cxrfl.fl.base.TaskExecutor`. A site whose
task fails or times out is left out of that task with a warning; a round with fewer than
``min_clients`` valid results is run again until ``min_clients_timeout``; the run stops
(``panic``) with the reason when nothing is left to go on with.

Tasks: see :mod:`cxrfl.fedfew.protocol`. Written to the server's app folder: see
:mod:`cxrfl.fedfew.server` (``fedfew/stage*``, ``FL_global_model.pt``, ``cxrfl/*.jsonl|json``).

Resuming a stopped run: submit the job again with ``resume_from`` set to the interrupted job's
id (its finished stages are kept in ``<server workspace>/cxrfl_resume/<job id>/``); finished
stages are loaded, not run again. A folder is never accepted (the job's submitter would choose
what the server reads).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cxrfl.clinical.pooling import PooledEvaluation
from cxrfl.data.site import SiteData
from cxrfl.errors import ConfigError
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.protocol import FedFewSiteHost
from cxrfl.fedfew.server import FedFewServer
from cxrfl.fl.base import Scalars, TaskController, TaskExecutor, mean_over_sites
from cxrfl.nn.models import ModelConfig


class FedFew(TaskController):
    """The FedFew workflow: self-supervised pretraining, energy-based CC training, threshold and prototypes.

    Args:
        fedfew_config: :class:`cxrfl.fedfew.config.FedFewConfig` fields (sent to the sites).
        model_config: :class:`cxrfl.nn.models.ModelConfig` fields (``pretrained`` is read here, on
            the server, for the initial encoder only).
        min_clients: fewest valid site results that make a round (stages 1-2) and sites that must
            answer at the start; a round with fewer is run again.
        min_clients_timeout: seconds a round (or the start) with fewer than ``min_clients`` valid
            results is retried; then the job stops with the reason.
        retry_pause: seconds between two attempts.
        task_timeout: seconds a site may take per task (0: no limit).
        resume_from: go on from an interrupted run: its job id on this server; None: run every stage.
        resume: removed (it named a folder); given, the job is refused with what to set instead.
        evaluate_test: evaluate the final model on every site's test split.
        pooled: how that evaluation counts the CC scores at the sites and pools them per class
            (:class:`cxrfl.clinical.pooling.PooledEvaluation` fields; None: defaults).
        analytic_sender_id: the server's analytics writer for the sites' mean losses per round
            (:meth:`record_scalars`; "": none).
    """

    def __init__(
        self,
        *,
        fedfew_config: dict | None = None,
        model_config: dict | None = None,
        min_clients: int = 1,
        min_clients_timeout: float = 600,
        retry_pause: float = 10,
        task_timeout: int = 0,
        resume_from: str | None = None,
        resume: str | None = None,
        evaluate_test: bool = True,
        pooled: dict | None = None,
        analytic_sender_id: str = "analytic_sender",
    ) -> None:
        super().__init__(task_timeout=task_timeout, analytic_sender_id=analytic_sender_id)
        if isinstance(min_clients, bool) or not isinstance(min_clients, int) or min_clients < 1:
            raise ValueError(f"min_clients must be an integer >= 1, got {min_clients!r}")
        if resume:
            raise ConfigError(
                f"FedFew: resume={resume!r} is no longer accepted (a folder the server would read); "
                f"set resume_from to the interrupted job's id on this server instead"
            )
        self.config = FedFewConfig.from_dict(fedfew_config)
        self.network = ModelConfig.from_dict(model_config or {})
        if min_clients_timeout < 0 or retry_pause < 0:
            raise ValueError("min_clients_timeout and retry_pause must be >= 0")
        self.min_clients = min_clients
        self.min_clients_timeout = min_clients_timeout
        self.retry_pause = retry_pause
        self.resume_from = resume_from
        self.evaluate_test = evaluate_test
        self._pooled = PooledEvaluation.from_dict(pooled, where="the FedFew controller's pooled argument")

    def make_server(self, **common: Any) -> FedFewServer:
        return FedFewServer(
            config=self.config,
            model_config=self.network,
            min_clients=self.min_clients,
            min_clients_timeout=self.min_clients_timeout,
            retry_pause=self.retry_pause,
            resume_from=self.resume_from,
            evaluate_test=self.evaluate_test,
            pooled=self._pooled,
            **common,
        )

    def record_scalars(self, name: str, record: Mapping[str, Any]) -> Scalars | None:
        """Per completed stage-1/2 round: the sites' mean SimSiam or training loss and, when stage 2
        scores its rounds, the pooled validation loss and the sites' mean CC AUROC."""
        if name != "rounds.jsonl" or record.get("stage") not in (1, 2) or "round" not in record or record.get("status"):
            return None
        values = mean_over_sites(record.get("site_metrics") or {}, ("ssl_loss", "train_loss"))
        values.update(mean_over_sites(record.get("site_validation") or {}, ("cc_mean_auroc",)))
        if record.get("val_loss") is not None:
            values["val_loss"] = float(record["val_loss"])
        return values, int(record["round"])


class FedFewExecutor(TaskExecutor):
    """A FedFew site: answers the tasks of :data:`cxrfl.fedfew.protocol.TASKS` with its own data.

    Finds and checks the site's data at start like every cxrfl executor (:class:`cxrfl.fl.base.TaskExecutor`);
    the settings of every task come from the server.
    """

    def make_host(self, data: SiteData, device: torch.device, state_root: Path) -> FedFewSiteHost:
        return FedFewSiteHost(data, device, self.num_workers)
