"""NVFlare glue of surgical aggregation and its baselines: the workflow and the site executor.

The round loop is :class:`cxrfl.surgical.server.SurgicalServer` (warm-up, rounds, retries, model
selection, resume, evaluation; see there for the files written to the server's app folder); the
site side is :class:`cxrfl.surgical.host.SurgicalSiteHost`. This module only carries their
messages over NVFlare (:mod:`cxrfl.fl.base`). The baselines of the papers are other
``head_mode`` values (:mod:`cxrfl.surgical.head_modes`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cxrfl.common.server import ServerLoop
from cxrfl.common.transport import SiteHost
from cxrfl.data.site import SiteData
from cxrfl.fl.base import Scalars, TaskController, TaskExecutor, mean_over_sites
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import SurgicalSiteHost
from cxrfl.surgical.server import SurgicalServer

_DEFAULTS = SurgicalConfig()


class SurgicalAggregation(TaskController):
    """Surgical aggregation for class-heterogeneous federated multi-label learning (or a baseline:
    ``head_mode``), as an NVFlare workflow.

    Args:
        task_timeout: seconds a site may take per task (0: no limit; a dead site's task still ends
            when NVFlare deems the site dead).
        analytic_sender_id: the server's analytics writer for the aggregated metrics
            (:meth:`record_scalars`; "": none).
        settings: every other argument is the :class:`cxrfl.surgical.config.SurgicalConfig` setting
            of the same name (meaning and default there; ``model_config`` and ``train_config`` as
            dicts of their fields): num_rounds, min_clients, model_config, train_config, batchnorm,
            weighting, robust, clip_norm, max_num_samples, patience, min_delta, min_clients_timeout, resume_from,
            seed, evaluate_test, external_test, pooled, keep_round_checkpoints, head_mode, missing, selection,
            retry_pause.
    """

    def __init__(
        self,
        *,
        num_rounds: int = _DEFAULTS.num_rounds,
        min_clients: int = _DEFAULTS.min_clients,
        model_config: dict | None = None,
        train_config: dict | None = None,
        batchnorm: str = _DEFAULTS.batchnorm,
        weighting: str = _DEFAULTS.weighting,
        robust: str | None = _DEFAULTS.robust,
        clip_norm: float | None = _DEFAULTS.clip_norm,
        max_num_samples: int = _DEFAULTS.max_num_samples,
        patience: int = _DEFAULTS.patience,
        min_delta: float = _DEFAULTS.min_delta,
        task_timeout: int = 0,
        min_clients_timeout: float = _DEFAULTS.min_clients_timeout,
        resume_from: str | None = _DEFAULTS.resume_from,
        seed: int = _DEFAULTS.seed,
        evaluate_test: bool = _DEFAULTS.evaluate_test,
        external_test: str | None = _DEFAULTS.external_test,
        pooled: dict | None = None,
        keep_round_checkpoints: bool = _DEFAULTS.keep_round_checkpoints,
        head_mode: str = _DEFAULTS.head_mode,
        missing: str = _DEFAULTS.missing,
        selection: str = _DEFAULTS.selection,
        retry_pause: float = _DEFAULTS.retry_pause,
        analytic_sender_id: str = "analytic_sender",
    ) -> None:
        super().__init__(task_timeout=task_timeout, analytic_sender_id=analytic_sender_id)
        self.config = SurgicalConfig.from_dict(
            {
                "num_rounds": num_rounds,
                "min_clients": min_clients,
                "model_config": model_config,
                "train_config": train_config,
                "batchnorm": batchnorm,
                "weighting": weighting,
                "robust": robust,
                "clip_norm": clip_norm,
                "max_num_samples": max_num_samples,
                "patience": patience,
                "min_delta": min_delta,
                "min_clients_timeout": min_clients_timeout,
                "resume_from": resume_from,
                "seed": seed,
                "evaluate_test": evaluate_test,
                "external_test": external_test,
                "pooled": pooled,
                "keep_round_checkpoints": keep_round_checkpoints,
                "head_mode": head_mode,
                "missing": missing,
                "selection": selection,
                "retry_pause": retry_pause,
            },
            where="the SurgicalAggregation arguments of the job's server config",
        )

    @property
    def discloses_class_names(self) -> bool:
        """Only the ``union`` head (vanilla FL, FL with partial loss) sends every site the union of classes."""
        return self.config.head_mode == "union"

    def make_server(self, **common: Any) -> ServerLoop:
        return SurgicalServer(config=self.config, **common)

    def record_scalars(self, name: str, record: Mapping[str, Any]) -> Scalars | None:
        """Per warm-up or round: the sites' mean training and validation loss, mean AUROC and, per
        class, the mean AUROC of the sites that have it (the model they received), and how many
        sites were aggregated; at the round's step as each site's own metrics are."""
        if name != "rounds.jsonl" or record.get("phase") not in ("warmup", "train"):
            return None
        sites = record.get("site_metrics") or {}
        values = mean_over_sites(sites, ("train_loss", "val_loss", "val_mean_auroc"), per_class="val_auroc")
        values["sites_aggregated"] = float(len(record.get("sites_aggregated") or ()))
        return values, int(record["round"])


class SurgicalExecutor(TaskExecutor):
    """A surgical-aggregation site: answers ``train`` and ``validate`` with its own data.

    Args: see :class:`cxrfl.fl.base.TaskExecutor` (device, num_workers, num_threads, analytic_sender_id).
    """

    def make_host(self, data: SiteData, device: torch.device, state_root: Path) -> SiteHost:
        return SurgicalSiteHost(data, state_root, device=device, num_workers=self.num_workers)


class SiteExecutor(SurgicalExecutor):
    """The old name of :class:`SurgicalExecutor`, for job configs exported before it was renamed; it works
    for one more release and says so once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        logging.getLogger(__name__).warning(
            "cxrfl.fl.surgical.SiteExecutor is deprecated and goes in the next release: the job's "
            "config_fed_client.json should name cxrfl.fl.surgical.SurgicalExecutor (export the job again)"
        )
