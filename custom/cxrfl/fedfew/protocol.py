"""The FedFew tasks as plain messages: what the server sends, what a site answers.

A message is ``(params, meta)``: a dict of numpy arrays and a JSON-friendly dict. The NVFlare
glue (:mod:`cxrfl.fl.fedfew`) wraps them in ``FLModel``; the in-process runner passes them as
they are. :func:`handle_task` is the whole site side, shared by both.

Tasks (every task's ``meta`` carries ``fedfew_config`` and ``model_config``; stage-2/3 tasks also
``cc_classes`` and ``uc_classes``, the UCs of the receiving site only):

==================  =============================================  ==============================================
task                server sends                                   site answers (meta)
==================  =============================================  ==============================================
fedfew_info         nothing                                        ``info``: classes and label counts
fedfew_ssl          SimSiam weights, ``round``                     weights, ``num_samples``, ``metrics``
fedfew_train        stage-2 weights, ``round``, ``energy_weight``,  weights, ``num_samples``, ``metrics``
                    ``m_in``, ``m_out``
fedfew_energy       stage-2 weights, ``mode``: ``means`` /          ``stats``: energy sums and counts / range /
                    ``range`` / ``counts`` (with ``grid``)          errors per candidate threshold
fedfew_prototypes   stage-2 weights                                ``prototypes`` (payloads), ``refused``
fedfew_validate     stage-2 weights, ``threshold``, ``prototypes``  ``metrics``
==================  =============================================  ==============================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

import torch

from cxrfl.data.site import SiteData
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.learner import FedFewSite
from cxrfl.fedfew.prototypes import DualPrototype
from cxrfl.nn.models import ModelConfig

INFO, SSL, TRAIN, ENERGY, PROTOTYPES, VALIDATE = (
    "fedfew_info", "fedfew_ssl", "fedfew_train", "fedfew_energy", "fedfew_prototypes", "fedfew_validate",
)
TASKS: tuple[str, ...] = (INFO, SSL, TRAIN, ENERGY, PROTOTYPES, VALIDATE)
"""Every task a FedFew site answers."""

Message = tuple[dict[str, np.ndarray], dict[str, Any]]


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
        update = site.train_round(params, int(meta.get("round", 0)), energy_weight=float(meta.get("energy_weight", 0.0)),
                                  m_in=meta.get("m_in"), m_out=meta.get("m_out"))
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
    if task == PROTOTYPES:
        return {}, site.prototypes(params)
    if task == VALIDATE:
        protos: dict[str, list[DualPrototype]] = {}
        for p in meta.get("prototypes") or []:
            protos.setdefault(str(p["uc"]), []).append(DualPrototype.from_payload(p))
        metrics = site.evaluate(params, threshold=float(meta["threshold"]), prototypes=protos,
                                split=str(meta.get("split", "test")))
        return {}, {"metrics": metrics}
    raise ValueError(f"unknown FedFew task {task!r}")


class SiteHost:
    """One site's endpoint: builds its :class:`FedFewSite` for the settings a task carries
    (reused while they stay the same) and answers the task.

    Args:
        data: the site's data.
        device: torch device.
        num_workers: data-loader workers.
    """

    def __init__(self, data: SiteData, device: torch.device | None = None, num_workers: int = 0) -> None:
        self.data = data
        self.device = device or torch.device("cpu")
        self.num_workers = num_workers
        self._site: FedFewSite | None = None
        self._key: tuple | None = None

    def site_for(self, meta: Mapping[str, Any]) -> FedFewSite:
        """The site object for the settings in ``meta``."""
        model_config, config = site_settings(meta)
        key = (model_config, config)
        if self._site is None or key != self._key:
            self._site = FedFewSite(self.data, model_config=model_config, config=config, device=self.device,
                                    num_workers=self.num_workers)
            self._key = key
        return self._site

    def handle(self, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]) -> Message:
        """Answer one task (see :func:`handle_task`)."""
        return handle_task(self.site_for(meta), task, params, meta)
