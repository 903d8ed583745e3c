"""FedFew without NVFlare: the same server workflow and site code, sites called in-process.

Used by the benchmark and the tests; the transport is :func:`cxrfl.common.transport.inprocess_transport`
(arrays copied both ways; a site whose task raises is left out of that task with a message,
exactly as a failing NVFlare site is).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from cxrfl.common.inprocess import RunResult
from cxrfl.common.transport import inprocess_transport
from cxrfl.data.site import SiteData
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.protocol import FedFewSiteHost
from cxrfl.fedfew.rounds import RoundHook
from cxrfl.fedfew.server import FedFewOutcome, FedFewServer
from cxrfl.nn.models import ModelConfig

log = logging.getLogger(__name__)


def run_fedfew(
    sites: Mapping[str, SiteData],
    config: FedFewConfig,
    out_dir: str | Path,
    *,
    run_id: str = "run",
    resume_from: str | None = None,
    resume_root: str | Path | None = None,
    info: Callable[[str], None] = log.info,
    warning: Callable[[str], None] = log.warning,
    aborted: Callable[[], bool] = lambda: False,
    model_config: ModelConfig,
    device: torch.device | None = None,
    min_clients: int = 1,
    min_clients_timeout: float = 0,
    retry_pause: float = 0,
    evaluate_test: bool = False,
    site_info: Callable[[str], None] | None = None,
    hosts: Mapping[str, FedFewSiteHost] | None = None,
    on_round: RoundHook | None = None,
) -> RunResult[FedFewOutcome]:
    """Run the three FedFew stages over in-memory sites (the signature every method's runner has:
    :mod:`cxrfl.common.inprocess`).

    Args:
        sites: site name -> its data.
        config: FedFew settings.
        out_dir: where the stage results and the final model go.
        run_id: this run's id (names its resume folder).
        resume_from: an interrupted run's id (its resume folder under ``resume_root``; see
            :mod:`cxrfl.fedfew.server`).
        resume_root: folder of resume folders (default ``out_dir/cxrfl_resume``).
        info: progress logger.
        warning: problem logger.
        aborted: returns True when the run must stop.
        model_config: network settings.
        device: torch device of the sites.
        min_clients: fewest valid results per round.
        min_clients_timeout: seconds a round with fewer is retried before the run stops (in-process
            sites do not come back by themselves: 0 stops at once).
        retry_pause: seconds between two attempts.
        evaluate_test: evaluate the final model on the sites' test splits.
        site_info: where the sites' one line per task goes (None: nowhere).
        hosts: reuse these site hosts (e.g. to keep their caches between runs).
        on_round: called after every completed round of stages 1-2 (:data:`cxrfl.fedfew.rounds.RoundHook`).
    """
    start = time.perf_counter()
    hosts = dict(hosts) if hosts is not None else {s: FedFewSiteHost(d, device) for s, d in sites.items()}
    server = FedFewServer(
        inprocess_transport(hosts, warning, site_info),
        sites=list(sites),
        run_id=run_id,
        config=config,
        model_config=model_config,
        out_dir=out_dir,
        min_clients=min_clients,
        min_clients_timeout=min_clients_timeout,
        retry_pause=retry_pause,
        resume_from=resume_from,
        resume_root=resume_root,
        evaluate_test=evaluate_test,
        info=info,
        warning=warning,
        aborted=aborted,
        on_round=on_round,
    )
    outcome = server.run()
    return RunResult(outcome=outcome, seconds=time.perf_counter() - start)
