"""NVFlare glue of surgical aggregation and its baselines: the workflow and the site executor.

The round loop is :class:`cxrfl.surgical.server.SurgicalServer` (warm-up, rounds, retries, model
selection, resume, evaluation; see there for the files written to the server's app folder); the
site side is :class:`cxrfl.surgical.host.SurgicalSiteHost`. This module only carries their
messages over NVFlare (:mod:`cxrfl.fl.base`). The baselines of the papers are other
``head_mode`` values (:mod:`cxrfl.surgical.head_modes`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cxrfl.common.server import ServerLoop
from cxrfl.common.transport import SiteHost
from cxrfl.data.site import SiteData
from cxrfl.errors import ConfigError
from cxrfl.fl.aggregator import AGGREGATION_POLICY, SurgicalAggregator
from cxrfl.fl.base import Scalars, TaskController, TaskExecutor, mean_over_sites
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import SurgicalSiteHost
from cxrfl.surgical.server import SurgicalServer


class SurgicalAggregation(TaskController):
    """Surgical aggregation for class-heterogeneous federated multi-label learning (or a baseline:
    ``head_mode``), as an NVFlare workflow.

    Args:
        task_timeout: seconds a site may take per task (0: no limit; a dead site's task still ends
            when NVFlare deems the site dead).
        analytic_sender_id: the server's analytics writer for the aggregated metrics
            (:meth:`record_scalars`; "": none).
        aggregator_id: the job's aggregator component (a :class:`cxrfl.fl.aggregator.SurgicalAggregator`),
            which then declares the aggregation policy (:data:`cxrfl.fl.aggregator.AGGREGATION_POLICY`);
            "" (jobs exported before it existed): the policy is this workflow's own arguments.
        settings: every other argument is the :class:`cxrfl.surgical.config.SurgicalConfig` setting
            of the same name (meaning, default and checks there; ``model_config``, ``train_config`` and
            ``pooled`` as dicts of their fields); an unknown one stops the job with one line naming it.

    Raises:
        ConfigError: a bad setting, or a policy setting given here as well as on the aggregator component.
    """

    def __init__(
        self,
        *,
        task_timeout: int = 0,
        analytic_sender_id: str = "analytic_sender",
        aggregator_id: str = "",
        **settings: Any,
    ) -> None:
        super().__init__(task_timeout=task_timeout, analytic_sender_id=analytic_sender_id)
        where = "the SurgicalAggregation arguments of the job's server config"
        twice = sorted(set(settings) & set(AGGREGATION_POLICY))
        if aggregator_id and twice:
            raise ConfigError(
                f"{where}: {', '.join(twice)} set here and on the aggregator component {aggregator_id!r}; "
                "set them on the component only (it is the aggregation the job runs)"
            )
        self.aggregator_id = aggregator_id
        self.config = SurgicalConfig.from_dict(settings, where=where)

    # the settings are SurgicalConfig's, declared there once; this is what the job exporter and readers see
    __init__.__signature__ = SurgicalConfig.as_keywords(  # type: ignore[attr-defined]
        inspect.Parameter("task_timeout", inspect.Parameter.KEYWORD_ONLY, default=0, annotation="int"),
        inspect.Parameter(
            "analytic_sender_id", inspect.Parameter.KEYWORD_ONLY, default="analytic_sender", annotation="str"
        ),
        inspect.Parameter("aggregator_id", inspect.Parameter.KEYWORD_ONLY, default="", annotation="str"),
    )

    @property
    def discloses_class_names(self) -> bool:
        """Only the ``union`` head (vanilla FL, FL with partial loss) sends every site the union of classes."""
        return self.config.head_mode == "union"

    def make_server(self, **common: Any) -> ServerLoop:
        """The surgical server loop; with ``aggregator_id``, of the component's policy and round aggregator."""
        if not self.aggregator_id:
            return SurgicalServer(config=self.config, **common)
        component = self.engine.get_component(self.aggregator_id)
        if not isinstance(component, SurgicalAggregator):
            raise ConfigError(
                f"aggregator_id {self.aggregator_id!r} of SurgicalAggregation names "
                f"{'no component' if component is None else 'a ' + type(component).__name__} in the job's "
                "server config; it must name a cxrfl.fl.aggregator.SurgicalAggregator (or a subclass)"
            )
        where = f"the aggregator component {self.aggregator_id!r} of the job's server config"
        # the run's record and checks see the policy the component declares
        config = SurgicalConfig.from_dict({**self.config.to_dict(), **component.policy()}, where=where)
        return SurgicalServer(config=config, aggregator_factory=component.bind, **common)

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
