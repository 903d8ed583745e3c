"""Head warm-ups shared by a benchmark's runs: the :class:`cxrfl.surgical.host.Warmups` the
benchmarks hand to their in-process surgical sites."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch

from cxrfl.common.io import params_digest
from cxrfl.surgical.host import LearnerSettings


class WarmupCache:
    """Head warm-ups done in this process, taken over by later runs of the same site with the same
    settings and initial model (a benchmark's methods share one warm-up per seed)."""

    def __init__(self) -> None:
        self._done: dict[Hashable, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}

    @staticmethod
    def key(site: str, params: Mapping[str, Any], settings: LearnerSettings) -> Hashable:
        """What a warm-up depends on: the site, the initial model, the network and training settings.

        Args:
            site: the site name.
            params: the received initial feature extractor.
            settings: the learner's settings.
        """
        return site, params_digest(params), settings.model_config, settings.train_config

    def get(self, key: Hashable) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The model state and metrics of an earlier warm-up (None: none yet).

        Args:
            key: from :meth:`key`.
        """
        return self._done.get(key)

    def put(self, key: Hashable, state: dict[str, torch.Tensor], metrics: dict[str, Any]) -> None:
        """Keep a warm-up.

        Args:
            key: from :meth:`key`.
            state: the full model state after it.
            metrics: its metrics.
        """
        self._done[key] = (state, dict(metrics))
