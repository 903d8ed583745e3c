"""A FedFew site executor with injected failures (fault injection for tests).

It is copied into a test job's ``app/custom`` folder. Each site answers like
:class:`cxrfl.fl.fedfew.FedFewExecutor`, except that the tasks named in ``faults`` raise once
(the first time that task's round is asked for; remembered in a file of the site's workspace,
since the simulator may rebuild the executor between tasks): the site fails mid-stage, as a
crashed or unreachable site does. Sites in ``keep_received`` save the weights of each stage-2
round they receive (``received_train_<r>.pt`` in the site's workspace), so a test can compare them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cxrfl.data.site import SiteData
from cxrfl.fedfew import protocol as P
from cxrfl.fl.fedfew import FedFewExecutor


class FaultyFedFewHost(P.FedFewSiteHost):
    """A FedFew site host that fails the scheduled tasks once.

    Args:
        data: the site's data.
        folder: where the markers of injected faults and the received weights go.
        faults: ``"<task>:<round>"`` entries (e.g. ``"fedfew_ssl:1"``) that raise once.
        keep_received: save the weights received in each ``fedfew_train`` round.
        kwargs: :class:`cxrfl.fedfew.protocol.SiteHost` arguments.
    """

    def __init__(self, data: SiteData, folder: Path, *, faults: list[str], keep_received: bool, **kwargs: Any) -> None:
        super().__init__(data, **kwargs)
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.faults = set(faults)
        self.keep_received = keep_received

    def handle(self, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]):
        key = f"{task}:{meta.get('round')}"
        marker = self.folder / f"fault_{key.replace(':', '_')}"
        if key in self.faults and not marker.exists():
            marker.touch()
            raise RuntimeError(f"injected failure of site {self.data.site} in {key}")
        if task == P.TRAIN and self.keep_received:
            torch.save(
                {k: torch.as_tensor(np.asarray(v)) for k, v in params.items()},
                self.folder / f"received_train_{meta.get('round')}.pt",
            )
        return super().handle(task, params, meta)


class FaultyFedFewExecutor(FedFewExecutor):
    """FedFewExecutor with scheduled failures.

    Args:
        faults: site -> the ``"<task>:<round>"`` entries that fail once at that site.
        keep_received: sites that save the stage-2 weights they receive.
        kwargs: :class:`cxrfl.fl.fedfew.FedFewExecutor` arguments.
    """

    def __init__(self, faults: dict | None = None, keep_received: list | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.faults = {site: list(keys) for site, keys in (faults or {}).items()}
        self.keep_received = set(keep_received or ())

    def make_host(self, data: SiteData, device: torch.device, state_root: Path) -> P.FedFewSiteHost:
        return FaultyFedFewHost(
            data,
            state_root / "faults",
            faults=self.faults.get(data.site, []),
            keep_received=data.site in self.keep_received,
            device=device,
            num_workers=self.num_workers,
        )
