"""FedFew without NVFlare: the same server workflow and site code, sites called in-process.

Used by the benchmark and the tests; a site whose task raises is left out of that task with a
message, exactly as a failing NVFlare site is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from cxrfl.data.site import SiteData
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.protocol import Message, SiteHost
from cxrfl.fedfew.server import FedFewOutcome, FedFewServer, Send
from cxrfl.nn.models import ModelConfig


def inprocess_transport(hosts: Mapping[str, SiteHost], warning: Callable[[str], None] = print) -> Send:
    """A transport that calls each site's :class:`SiteHost` in turn.

    Args:
        hosts: site name -> its host.
        warning: where a failing site's message goes.
    """

    def send(task: str, payloads: dict[str, Message]) -> dict[str, Message]:
        out: dict[str, Message] = {}
        for site, (params, meta) in payloads.items():
            try:
                out[site] = hosts[site].handle(task, params, meta)
            except Exception as exc:  # one failing site must not stop the others
                warning(f"site {site}: task {task} failed: {type(exc).__name__}: {exc}")
        return out

    return send


def run_fedfew(data: Mapping[str, SiteData], *, config: FedFewConfig, model_config: ModelConfig, out_dir: str | Path,
               device: torch.device | None = None, min_clients: int = 1, resume: str | Path | None = None,
               evaluate_test: bool = False, info: Callable[[str], None] = print,
               warning: Callable[[str], None] = print, hosts: Mapping[str, SiteHost] | None = None) -> FedFewOutcome:
    """Run the three FedFew stages over in-memory sites.

    Args:
        data: site name -> its data.
        config: FedFew settings.
        model_config: network settings.
        out_dir: where the stage results and the final model go.
        device: torch device of the sites.
        min_clients: fewest valid results per round.
        resume: an earlier run's stage folder (see :mod:`cxrfl.fedfew.server`).
        evaluate_test: evaluate the final model on the sites' test splits.
        info: progress logger.
        warning: problem logger.
        hosts: reuse these site hosts (e.g. to keep their caches between runs).
    """
    hosts = dict(hosts) if hosts is not None else {s: SiteHost(d, device) for s, d in data.items()}
    server = FedFewServer(inprocess_transport(hosts, warning), sites=list(data), config=config, model_config=model_config,
                          out_dir=out_dir, min_clients=min_clients, resume=resume, evaluate_test=evaluate_test,
                          info=info, warning=warning)
    return server.run()
