"""Surgical aggregation without NVFlare: the same server and site hosts, the sites called in this process.

:func:`run_surgical` runs :class:`cxrfl.surgical.server.SurgicalServer` with
:func:`cxrfl.common.transport.inprocess_transport` over one
:class:`cxrfl.surgical.host.SurgicalSiteHost` per site: what the benchmark (``cxrfl bench
compare``) and the fast tests run. With one site it is local training (the individually trained
and centralized baselines): aggregating a single update returns it unchanged. A
:class:`cxrfl.surgical.host.Warmups` lets several runs share the sites' head warm-ups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.common.inprocess import RunResult
from cxrfl.common.transport import Message, OnAnswer, Send, SiteHost, inprocess_transport
from cxrfl.data.site import SiteData
from cxrfl.nn.models import ModelConfig, build_model
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import TRAIN, SurgicalSiteHost, Warmups
from cxrfl.surgical.server import SurgicalOutcome, SurgicalServer

log = logging.getLogger(__name__)


@dataclass
class InProcessResult(RunResult[SurgicalOutcome]):
    """A finished in-process run (:class:`cxrfl.common.inprocess.RunResult`: ``outcome``, what the server
    returned: selected model, learning curve, evaluation; ``seconds``).

    Args:
        site_states: local heads or FedBN: site -> its whole model (own head rows, own BatchNorm) at
            the selected round (None otherwise).
        images_per_second: mean local training throughput over sites and rounds.
        comm: site -> bytes it received (``down``) and sent (``up``) in the last training round.
    """

    site_states: dict[str, dict[str, torch.Tensor]] | None = None
    images_per_second: float = 0.0
    comm: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def classes(self) -> list[str]:
        """The global head's classes ([] for local heads)."""
        return self.outcome.classes

    @property
    def best_round(self) -> int:
        """The selected round."""
        return self.outcome.best_round

    @property
    def rounds(self) -> int:
        """Rounds completed."""
        return self.outcome.last_round

    def curve(self, key: str) -> list[float]:
        """A learning curve over the scored models (index = model round).

        Args:
            key: ``mean_val_loss`` or ``mean_val_auroc``.
        """
        return [p[key] for p in self.outcome.curve]

    def site_curves(self, key: str) -> dict[str, list[float | None]]:
        """Per-site learning curves.

        Args:
            key: ``site_val_loss`` or ``site_val_auroc``.
        """
        return {s: [p[key].get(s) for p in self.outcome.curve] for s in self.outcome.site_classes}


def nbytes(params: Mapping[str, Any]) -> int:
    """Bytes of the arrays in a parameter dict (what travels, before serialisation overhead).

    Args:
        params: name -> array.
    """
    return int(sum(np.asarray(v).nbytes for v in params.values()))


def _metered(send: Send, comm: dict[str, dict[str, int]], speeds: list[float]) -> Send:
    """``send`` that notes the bytes of each training round and the sites' training speed."""

    def wrapped(task: str, payloads: dict[str, Message], *, on_answer: OnAnswer | None = None) -> dict[str, Message]:
        sent: dict[str, int] = {}
        kept: dict[str, dict[str, Any]] = {}  # whole answers for a caller that does not stream

        def note(site: str, answer: Message) -> None:
            sent[site] = nbytes(answer[0])
            if on_answer is None:
                kept[site] = answer[0]
            else:
                on_answer(site, answer)

        answers = send(task, payloads, on_answer=note)
        if task == TRAIN:
            for site, (_, meta) in answers.items():
                if payloads[site][1].get("phase") == "train":
                    comm[site] = {"down": nbytes(payloads[site][0]), "up": sent[site]}
                speed = (meta.get("metrics") or {}).get("images_per_second")
                if speed:
                    speeds.append(float(speed))
        return {s: (kept.get(s, p), m) for s, (p, m) in answers.items()}

    return wrapped


def make_hosts(
    sites: Sequence[SiteData],
    state_root: str | Path,
    *,
    warmups: Warmups | None = None,
    train_overrides: Mapping[str, Mapping[str, Any]] | None = None,
    device: torch.device | None = None,
) -> dict[str, SurgicalSiteHost]:
    """One host per site, keeping its state under ``state_root/<site>``.

    Args:
        sites: the sites' data.
        state_root: folder of the sites' states.
        warmups: warm-ups shared between runs (None: each run trains its own).
        train_overrides: site -> train settings it replaces (e.g. a step cap).
        device: torch device of the sites.
    """
    return {
        d.site: SurgicalSiteHost(
            d,
            Path(state_root) / d.site,
            device=device,
            warmups=warmups,
            train_overrides=(train_overrides or {}).get(d.site),
        )
        for d in sites
    }


def run_surgical(
    sites: Sequence[SiteData] | Mapping[str, SiteHost],
    config: SurgicalConfig,
    out_dir: str | Path,
    *,
    run_id: str = "run",
    resume_from: str | None = None,
    resume_root: str | Path | None = None,
    info: Callable[[str], None] = log.info,
    warning: Callable[[str], None] = log.warning,
    aborted: Callable[[], bool] = lambda: False,
    warmups: Warmups | None = None,
    train_overrides: Mapping[str, Mapping[str, Any]] | None = None,
    device: torch.device | None = None,
) -> InProcessResult:
    """Run the surgical-aggregation server over in-process sites (the signature every method's runner
    has: :mod:`cxrfl.common.inprocess`).

    Args:
        sites: the sites' data, or ready hosts by site name (e.g. wrapped by a test).
        config: the run's settings.
        out_dir: where the server writes (models, records); sites keep their state under ``out_dir/sites``.
        run_id: this run's id (names its resume state under ``resume_root``).
        resume_from: an interrupted run's id (None: ``config.resume_from``).
        resume_root: folder of resume states (default ``out_dir/cxrfl_resume``).
        warmups: warm-ups shared between runs.
        train_overrides: site -> train settings it replaces.
        device: torch device of the sites.
        info: progress logger (server and one line per site and task).
        warning: problem logger.
        aborted: returns True when the run must stop.

    Raises:
        RunStopped: the run could not go on (the message says why).
        RunAborted: ``aborted`` said so.
    """
    start = time.perf_counter()
    hosts = (
        dict(sites)
        if isinstance(sites, Mapping)
        else make_hosts(sites, Path(out_dir) / "sites", warmups=warmups, train_overrides=train_overrides, device=device)
    )
    comm: dict[str, dict[str, int]] = {}
    speeds: list[float] = []
    send = _metered(inprocess_transport(hosts, warning=warning, info=info), comm, speeds)
    server = SurgicalServer(
        send,
        config=config if resume_from is None else config.replace(resume_from=resume_from),
        sites=list(hosts),
        out_dir=out_dir,
        run_id=run_id,
        resume_root=resume_root,
        info=info,
        warning=warning,
        aborted=aborted,
    )
    outcome = server.run()
    site_states = None
    if config.head_mode == "local" or config.batchnorm == "fedbn":  # the sites' own heads or BatchNorm
        messages = server.tasks.messages(
            server.state, outcome.best_params, split="test", model_round=outcome.best_round
        )
        site_states = {s: hosts[s].model_state(*messages[s]) for s in messages}
    return InProcessResult(
        outcome=outcome,
        seconds=time.perf_counter() - start,
        site_states=site_states,
        images_per_second=float(np.mean(speeds)) if speeds else 0.0,
        comm=comm,
    )


def global_model(result: InProcessResult, model_config: ModelConfig) -> torch.nn.Module:
    """The selected global model.

    Args:
        result: a run with a global head.
        model_config: network settings.
    """
    if not result.classes:
        raise ValueError("local heads have no global model")
    model = build_model(ModelConfig.from_dict({**model_config.to_dict(), "pretrained": None}), len(result.classes))
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in result.outcome.best_params.items()})
    return model.eval()


def site_models(result: InProcessResult, model_config: ModelConfig) -> dict[str, torch.nn.Module]:
    """Local heads or FedBN: each site's own model at the selected round.

    Args:
        result: a run with local heads or local BatchNorm.
        model_config: network settings.
    """
    if result.site_states is None:
        raise ValueError("the run has one global model, not a model per site")
    config = ModelConfig.from_dict({**model_config.to_dict(), "pretrained": None})
    out = {}
    for name, state in result.site_states.items():
        model = build_model(config, len(result.outcome.site_classes[name]))
        model.load_state_dict(state)
        out[name] = model.eval()
    return out
