"""Run the evaluation-only server over in-process sites (tests, benchmarks, `cxrfl` commands)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from cxrfl.common.transport import SiteHost, inprocess_transport
from cxrfl.data.site import SiteData
from cxrfl.fedeval.config import FedEvalConfig
from cxrfl.fedeval.server import FedEvalServer
from cxrfl.nn.models import load_checkpoint
from cxrfl.surgical.inprocess import make_hosts

log = logging.getLogger(__name__)


def run_fedeval(
    sites: Sequence[SiteData] | Mapping[str, SiteHost],
    checkpoint: str | Path | Mapping[str, Any],
    config: FedEvalConfig,
    out_dir: str | Path,
    *,
    run_id: str = "fedeval",
    device: torch.device | None = None,
    info: Callable[[str], None] = log.info,
    warning: Callable[[str], None] = log.warning,
) -> dict[str, Any]:
    """Evaluate a checkpoint at in-process sites; returns the report (also in ``out_dir/cxrfl/evaluation.json``).

    Args:
        sites: the sites' data, or ready hosts by site name.
        checkpoint: a checkpoint file, or :func:`cxrfl.nn.models.load_checkpoint`'s dict.
        config: the run's settings.
        out_dir: the server's output folder (sites keep their state under ``out_dir/sites``).
        run_id: the run's id.
        device: torch device of the sites.
        info: progress logger.
        warning: problem logger.
    """
    hosts = sites if isinstance(sites, Mapping) else make_hosts(sites, Path(out_dir) / "sites", device=device)
    ckpt = load_checkpoint(checkpoint) if isinstance(checkpoint, (str, Path)) else checkpoint
    server = FedEvalServer(
        inprocess_transport(hosts, warning=warning),
        config=config,
        checkpoint=ckpt,
        sites=list(hosts),
        out_dir=out_dir,
        run_id=run_id,
        info=info,
        warning=warning,
    )
    return server.run()
