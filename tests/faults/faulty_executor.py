"""A site executor that sends malformed results on purpose (fault injection for tests).

It is copied into a test job's ``app/custom`` folder. Each site answers like
:class:`cxrfl.fl.surgical.SurgicalExecutor` (through a :class:`cxrfl.surgical.host.SurgicalSiteHost`),
except that in the rounds named in ``faults`` its ``train`` result is corrupted once (the first
time that round is asked for; remembered in a file of the site's workspace, since the simulator
may rebuild the executor between tasks). Sites in ``echo`` do not train in the federated rounds:
they send back what they received (a well-formed update of their own classes), which keeps a
test with many sites cheap. Sites in ``keep_received`` save what they receive in each federated
round (``received_round_<r>.pt`` in the site's workspace), so a test can compare those weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cxrfl.data.site import SiteData
from cxrfl.fl.surgical import SurgicalExecutor
from cxrfl.surgical.host import SurgicalSiteHost

log = logging.getLogger(__name__)

HEAD_W, HEAD_B = "classifier.weight", "classifier.bias"


def corrupt(params: dict, meta: dict, fault: str) -> None:
    """Apply one fault to a result in place."""
    body = sorted(
        k
        for k in params
        if not k.startswith("classifier.")
        and np.asarray(params[k]).ndim >= 1
        and np.issubdtype(np.asarray(params[k]).dtype, np.floating)
    )
    key = body[0]
    if fault in ("nan", "inf"):
        arr = np.array(params[key], dtype=np.float32, copy=True)
        arr.flat[0] = np.nan if fault == "nan" else np.inf
        params[key] = arr
    elif fault == "shape":
        params[key] = np.asarray(params[key])[:-1]
    elif fault == "missing_key":
        del params[key]
    elif fault == "extra_key":
        params["backbone.injected.weight"] = np.zeros(3, np.float32)
    elif fault == "unannounced":
        meta["classes"] = list(meta["classes"]) + ["Fracture"]
        params[HEAD_W] = np.vstack([params[HEAD_W], params[HEAD_W][:1]])
        params[HEAD_B] = np.concatenate([params[HEAD_B], params[HEAD_B][:1]])
    elif fault == "duplicate":
        meta["classes"] = [meta["classes"][0]] + list(meta["classes"][:-1])
    elif fault == "zero_samples":
        meta["num_samples"] = 0
    elif fault == "negative_samples":
        meta["num_samples"] = -5
    elif fault == "scale":
        params.update({k: np.asarray(v) * 1e6 for k, v in params.items()})
    else:
        raise ValueError(f"unknown fault {fault!r}")


class FaultyHost(SurgicalSiteHost):
    """A site host whose federated ``train`` answers follow a fault schedule.

    Args:
        data: the site's data.
        state_root: the site's state folder (its parent holds the markers of injected faults).
        faults: round (as a string) -> fault of this site; ``"warmup": "raise"``: the first head
            warm-up fails.
        echo: send back what was received instead of training.
        keep_received: save what is received in each federated round.
        kwargs: :class:`cxrfl.surgical.host.SurgicalSiteHost` arguments.
    """

    def __init__(
        self,
        data: SiteData,
        state_root: Path,
        *,
        faults: dict[str, str],
        echo: bool,
        keep_received: bool,
        **kwargs: Any,
    ) -> None:
        super().__init__(data, state_root, **kwargs)
        self.faults = faults
        self.echo = echo
        self.keep_received = keep_received

    def handle(self, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]):
        if task == "train" and meta.get("phase") == "warmup":
            marker = self.state_root.parent / "fault_injected_warmup"
            if self.faults.get("warmup") == "raise" and not marker.exists():  # fails once, answers when asked again
                marker.touch()
                raise RuntimeError("injected warm-up failure")
        if not (task == "train" and meta.get("phase") == "train"):
            return super().handle(task, params, meta)
        rnd = str(meta.get("round"))
        if self.keep_received:
            torch.save(
                {k: np.asarray(v) for k, v in params.items()}, self.state_root.parent / f"received_round_{rnd}.pt"
            )
        marker = self.state_root.parent / f"fault_injected_round_{rnd}"
        fault = None if marker.exists() else self.faults.get(rnd)
        if fault == "raise":  # the site's own training fails: the executor must answer with an error
            marker.touch()
            raise RuntimeError(f"injected failure in round {rnd}")
        if self.echo:
            out = dict(params)
            # the count its warm-up reported: the server rejects a count that changes (issue 40)
            out_meta = {
                "classes": list(meta.get("classes") or self.data.classes),
                "num_samples": len(self.data.split_table("train")),
                "metrics": {"phase": "train"},
            }
        else:
            out, out_meta = super().handle(task, params, meta)
            out = dict(out)
        if fault:
            marker.touch()
            corrupt(out, out_meta, fault)
            log.warning("fault injection: site %s round %s sends a result with fault %r", self.data.site, rnd, fault)
        return out, out_meta


class FaultyExecutor(SurgicalExecutor):
    """SurgicalExecutor with scheduled malformed results.

    Args:
        faults: site -> {round (as a string): fault}; faults: nan, inf, shape, missing_key,
            extra_key, unannounced, duplicate, zero_samples, negative_samples, scale, raise (an
            exception in the site's training); ``"warmup": "raise"``: the first warm-up fails.
        echo: sites that send back what they received instead of training.
        keep_received: sites that save what they receive in each federated round.
        kwargs: :class:`cxrfl.fl.surgical.SurgicalExecutor` arguments.
    """

    def __init__(
        self, faults: dict | None = None, echo: list | None = None, keep_received: list | None = None, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.faults = {site: {str(r): f for r, f in rounds.items()} for site, rounds in (faults or {}).items()}
        self.echo = set(echo or ())
        self.keep_received = set(keep_received or ())

    def make_host(self, data: SiteData, device: torch.device, state_root: Path) -> SurgicalSiteHost:
        return FaultyHost(
            data,
            state_root,
            faults=self.faults.get(data.site, {}),
            echo=data.site in self.echo,
            keep_received=data.site in self.keep_received,
            device=device,
            num_workers=self.num_workers,
        )
