"""Cyclical weight transfer in one process: the relay server with the sites called in this process.

:func:`run_cwt` runs :class:`cxrfl.cwt.server.CWTServer`, the loop of the NVFlare job, over
:func:`cxrfl.common.transport.inprocess_transport` and one :class:`cxrfl.cwt.host.CWTSiteHost`
per site (the benchmark's engine and the fast tests). Central hosting is the relay over one site
holding all the data.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cxrfl.common.inprocess import RunResult
from cxrfl.common.transport import SiteHost, inprocess_transport
from cxrfl.cwt.config import CWTConfig, RelayConfig
from cxrfl.cwt.host import CWTSiteHost, site_model_config
from cxrfl.cwt.relay import Visit
from cxrfl.cwt.server import CWTOutcome, CWTServer
from cxrfl.cwt.site import CWTSite
from cxrfl.nn.models import ModelConfig, build_model

log = logging.getLogger(__name__)

INPROCESS_RELAY = RelayConfig(min_sites_timeout=0.0, retry_pause=0.0, evaluate_test=False)
"""In one process nobody comes back later: a cycle with too few trained sites stops the run at once,
and the sites' test splits are left to the caller."""


@dataclass
class CWTResult(RunResult[CWTOutcome]):
    """Outcome of :func:`run_cwt` (:class:`cxrfl.common.inprocess.RunResult`: ``outcome``, everything the
    server returned, final weights, evaluation ...; ``seconds``).

    Args:
        model: the network with the best cycle's weights (on the sites' device).
        classes: its outputs.
        best_cycle: the cycle with the lowest pooled validation loss (the last cycle when no
            cycle had a finite loss).
        best_val_loss: that loss (NaN: none was finite).
        plan: site -> its steps and rate per visit.
        history: one record per completed cycle (order, visits, pooled validation loss).
        stopped_early: early stopping ended the run.
        cycles_run: the last completed cycle.
    """

    model: nn.Module
    classes: list[str]
    best_cycle: int
    best_val_loss: float
    plan: dict[str, Visit]
    history: list[dict[str, Any]] = field(default_factory=list)
    stopped_early: bool = False
    cycles_run: int = 0


def run_cwt(
    sites: Sequence[CWTSite],
    config: CWTConfig,
    out_dir: str | Path | None = None,
    *,
    run_id: str = "run",
    resume_from: str | None = None,
    resume_root: str | Path | None = None,
    info: Callable[[str], None] = log.info,
    warning: Callable[[str], None] = log.warning,
    aborted: Callable[[], bool] = lambda: False,
    model_config: ModelConfig,
    relay: RelayConfig | None = None,
    wrap: Callable[[str, SiteHost], SiteHost] | None = None,
) -> CWTResult:
    """Run the relay over in-memory sites (the signature every method's runner has: :mod:`cxrfl.common.inprocess`).

    Args:
        sites: the sites (built with the same classes, see :func:`cxrfl.cwt.site.make_sites`),
            in the fixed relay order.
        config: the run's settings (the sites are reconfigured to them).
        out_dir: where the job's files go (None: a temporary folder, removed at the end; give one to be
            able to resume an interrupted run).
        run_id: this run's id (names its resume state).
        resume_from: an interrupted run's id (its folder under ``resume_root``).
        resume_root: folder of resume states (default ``out_dir/cxrfl_resume``).
        info: progress logger.
        warning: problem logger.
        aborted: returns True when the run must stop.
        model_config: the network.
        relay: ``min_sites``, retry and evaluation settings (default :data:`INPROCESS_RELAY`);
            without ``site_order``, the order of ``sites``.
        wrap: ``(site name, host) -> host`` around each site's host (fault injection in tests).
    """
    start = time.perf_counter()
    if not sites:
        raise ValueError("run_cwt needs at least one site")
    classes = sites[0].classes
    if any(s.classes != classes for s in sites):
        raise ValueError("all sites must be built with the same classes (see make_sites)")
    relay = relay or INPROCESS_RELAY
    if relay.site_order is None:
        relay = relay.replace(site_order=[s.name for s in sites])
    hosts: dict[str, SiteHost] = {s.name: CWTSiteHost(site=s, warning=warning) for s in sites}
    if wrap is not None:
        hosts = {name: wrap(name, host) for name, host in hosts.items()}
    with tempfile.TemporaryDirectory(prefix="cxrfl-cwt-") as tmp:
        server = CWTServer(
            inprocess_transport(hosts, warning, info=log.debug),
            sites=list(hosts),
            config=config,
            model_config=model_config,
            relay=relay,
            out_dir=out_dir if out_dir is not None else tmp,
            run_id=run_id,
            resume_from=resume_from,
            resume_root=resume_root,
            info=info,
            warning=warning,
            aborted=aborted,
        )
        outcome = server.run()
    model = build_model(site_model_config(model_config), len(outcome.plan.classes)).to(sites[0].device)
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in outcome.best_weights.items()})
    return CWTResult(
        model=model,
        classes=list(outcome.plan.classes),
        best_cycle=outcome.best_cycle,
        best_val_loss=outcome.best_val_loss,
        plan=dict(outcome.plan.visits),
        history=outcome.state.history,
        stopped_early=outcome.stopped_early,
        cycles_run=outcome.state.cycle,
        seconds=time.perf_counter() - start,
        outcome=outcome,
    )
