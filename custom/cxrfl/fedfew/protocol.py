"""The FedFew tasks as plain messages: what the server sends, what a site answers.

A message is ``(params, meta)`` (:data:`cxrfl.common.transport.Message`). :class:`FedFewSiteHost` is a
site's endpoint (the :class:`cxrfl.common.transport.SiteHost` protocol): the NVFlare executor
(:class:`cxrfl.fl.fedfew.FedFewExecutor`) and the in-process transport
(:mod:`cxrfl.fedfew.inprocess`) both hand it every task; :func:`handle_task` is the whole site
side, shared by both.

Tasks (every task's ``meta`` carries ``fedfew_config``, without the federation's UC list
``uc_classes``, and ``model_config``; stage-2/3 tasks also ``cc_classes`` and ``uc_classes``, the
UCs of the receiving site only):

==================  =============================================  ==============================================
task                server sends                                   site answers (meta)
==================  =============================================  ==============================================
fedfew_info         nothing                                        ``info``: classes and label counts
fedfew_ssl          SimSiam weights, ``round``                     weights, ``num_samples``, ``metrics``
fedfew_train        stage-2 weights, ``round``, ``energy_weight``,  weights, ``num_samples``, ``metrics``
                    ``m_in``, ``m_out``
fedfew_energy       stage-2 weights, ``mode``: ``means`` /          ``stats``: energy sums and counts / range /
                    ``range`` / ``counts`` (with ``grid``)          errors per candidate threshold
fedfew_detectors    stage-2 weights                                ``prototypes`` or ``scorers`` (payloads, per
                                                                   ``detector``), ``refused``
fedfew_validate     stage-2 weights, ``split``, ``threshold`` and   ``metrics`` (``cc_loss``, AUROCs, UC metrics)
                    ``prototypes`` or ``scorers`` (all left out
                    when stage 2 scores its rounds on ``val``)
==================  =============================================  ==============================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cxrfl.common.transport import Message
from cxrfl.data.site import SiteData
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.detectors import PAYLOAD_KEYS, parse_detectors
from cxrfl.fedfew.learner import FedFewSite
from cxrfl.nn.models import ModelConfig

INFO, SSL, TRAIN, ENERGY, DETECTORS, VALIDATE = (
    "fedfew_info",
    "fedfew_ssl",
    "fedfew_train",
    "fedfew_energy",
    "fedfew_detectors",
    "fedfew_validate",
)
TASKS: tuple[str, ...] = (INFO, SSL, TRAIN, ENERGY, DETECTORS, VALIDATE)
"""Every task a FedFew site answers."""
SiteMeta = Callable[..., dict[str, Any]]
"""``meta(site, **extra)``: the meta of a stage-2/3 task for one site (the settings, ``extra``, the
site's roles: the CCs and its own UCs)."""


def site_settings(meta: Mapping[str, Any]) -> tuple[ModelConfig, FedFewConfig]:
    """The model and FedFew settings a task carries (the site never reads ``pretrained``)."""
    model_config = ModelConfig.from_dict({**(meta.get("model_config") or {}), "pretrained": None})
    return model_config, FedFewConfig.from_dict(meta.get("fedfew_config"))


def handle_task(site: FedFewSite, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]) -> Message:
    """Answer one task at a site.

    Args:
        site: the site (its settings must be those of ``meta``).
        task: one of :data:`TASKS`.
        params: received weights.
        meta: the task settings (see the module docstring).

    Returns:
        ``(params, meta)`` of the answer.

    Raises:
        ValueError: unknown task or mode; any error of the site's computation propagates.
    """
    if task == INFO:
        return {}, {"info": site.info()}
    if task == SSL:
        update = site.ssl_round(params, int(meta.get("round", 0)))
        return update.params, {"num_samples": update.num_samples, "metrics": update.metrics}
    site.set_roles(list(meta.get("cc_classes") or []), list(meta.get("uc_classes") or []))
    if task == TRAIN:
        update = site.train_round(
            params,
            int(meta.get("round", 0)),
            energy_weight=float(meta.get("energy_weight", 0.0)),
            m_in=meta.get("m_in"),
            m_out=meta.get("m_out"),
        )
        return update.params, {"num_samples": update.num_samples, "metrics": update.metrics}
    if task == ENERGY:
        mode = meta.get("mode")
        if mode == "means":
            return {}, {"stats": site.energy_means(params)}
        if mode == "range":
            return {}, {"stats": site.energy_range(params)}
        if mode == "counts":
            return {}, {"stats": site.threshold_counts(params, list(meta["grid"]))}
        raise ValueError(f"unknown fedfew_energy mode {mode!r}")
    if task == DETECTORS:
        return {}, site.detectors(params)
    if task == VALIDATE:
        kind = site.config.detector
        metrics = site.evaluate(
            params,
            threshold=float(meta.get("threshold", math.inf)),
            detectors=parse_detectors(kind, meta.get(PAYLOAD_KEYS[kind]) or []),
            counts=meta.get("counts"),
            split=str(meta.get("split", "test")),
        )
        return {}, {"metrics": metrics}
    raise ValueError(f"unknown FedFew task {task!r}")


def number(value: Any) -> str:
    """A metric for a log line: four decimals, or n/a."""
    return "n/a" if value is None else f"{float(value):.4f}"


def describe_uc(uc: str, metrics: Mapping[str, Any]) -> str:
    """A UC's detection metrics in a log line (see :func:`cxrfl.nn.detection.detection_metrics`)."""
    return (
        f"{uc} AUROC {number(metrics.get('auroc'))}, balanced accuracy {number(metrics.get('balanced_accuracy'))}, "
        f"F1 {number(metrics.get('f1'))} (flagging all: {number(metrics.get('f1_flag_all'))})"
    )


def describe_task(site: str, task: str, meta: Mapping[str, Any], answer: Mapping[str, Any]) -> str | None:
    """The operator's one log line for an answered task (a round of a stage, a statistics pass, the prototypes).

    Args:
        site: the site's name.
        task: the task.
        meta: what the server sent.
        answer: the site's answer meta.
    """
    m = answer.get("metrics") or {}
    if task == INFO:
        info = answer["info"]
        return (
            f"site {site}: {len(info['classes'])} class(es), {info['n_labelled']} labelled training image(s), "
            f"{info['n_ssl']} image(s) for self-supervised learning"
        )
    if task == SSL:
        return (
            f"site {site} stage 1 round {m.get('round')}: SimSiam loss {number(m.get('ssl_loss'))}, "
            f"{m.get('steps')} steps, time {m.get('seconds', 0):.1f}s"
        )
    if task == TRAIN:
        return (
            f"site {site} stage 2 round {m.get('round')} (lambda {m.get('energy_weight')}): "
            f"train_loss {number(m.get('train_loss'))} bce {number(m.get('train_bce'))} "
            f"hinge_in {number(m.get('train_hinge_in'))} hinge_out {number(m.get('train_hinge_out'))}, "
            f"{m.get('steps')} steps, time {m.get('seconds', 0):.1f}s"
        )
    if task == ENERGY:
        s = answer.get("stats") or {}
        return (
            f"site {site}: energy statistics ({meta.get('mode')}) over {s.get('n_in')} image(s) "
            f"without and {s.get('n_out')} with a UC"
        )
    if task == DETECTORS:
        key = next((k for k in PAYLOAD_KEYS.values() if k in answer), "prototypes")
        sent = [p["uc"] for p in answer.get(key) or []]
        refused = "".join(f"; refused: {reason}" for reason in (answer.get("refused") or {}).values())
        return f"site {site}: sent the {key} of {sent or 'no class'}{refused}"
    if task == VALIDATE:
        parts = [f"CC loss {number(m.get('cc_loss'))}", f"CC mean AUROC {number(m.get('cc_mean_auroc'))}"] + [
            describe_uc(uc, u) for uc, u in (m.get("uc") or {}).items()
        ]
        return f"site {site} {m.get('split')}: {'; '.join(parts)}"
    return None


class FedFewSiteHost:
    """One site's endpoint (:class:`cxrfl.common.transport.SiteHost`): builds its :class:`FedFewSite`
    for the settings a task carries (reused while they stay the same) and answers the task.

    Args:
        data: the site's data.
        device: torch device.
        num_workers: data-loader workers.
    """

    tasks: tuple[str, ...] = TASKS

    def __init__(self, data: SiteData, device: torch.device | None = None, num_workers: int = 0) -> None:
        self.data = data
        self.device = device or torch.device("cpu")
        self.num_workers = num_workers
        self._site: FedFewSite | None = None
        self._key: tuple | None = None

    def site_for(self, meta: Mapping[str, Any]) -> FedFewSite:
        """The site object for the settings in ``meta``.

        Args:
            meta: a task's settings.
        """
        model_config, config = site_settings(meta)
        key = (model_config, config)
        if self._site is None or key != self._key:
            self._site = FedFewSite(
                self.data, model_config=model_config, config=config, device=self.device, num_workers=self.num_workers
            )
            self._key = key
        return self._site

    def handle(self, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]) -> Message:
        """Answer one task (see :func:`handle_task`).

        Args:
            task: one of :data:`TASKS`.
            params: received weights.
            meta: the task settings.
        """
        return handle_task(self.site_for(meta), task, params, meta)

    def describe(self, task: str, meta: Mapping[str, Any], answer: Mapping[str, Any]) -> str | None:
        """The log line of an answered task (:func:`describe_task`).

        Args:
            task: the task.
            meta: what the server sent.
            answer: the answer meta.
        """
        return describe_task(self.data.site, task, meta, answer)

    def scalars(self, task: str, answer: Mapping[str, Any]) -> tuple[dict[str, float], int] | None:
        """The SimSiam loss of a stage-1 round, the training loss of a stage-2 round, with the round.

        Args:
            task: the task.
            answer: the answer meta.
        """
        m = answer.get("metrics") or {}
        name = {SSL: "ssl_loss", TRAIN: "train_loss"}.get(task)
        if name is None or m.get(name) is None:
            return None
        return {name: float(m[name])}, int(m.get("round") or 0)
