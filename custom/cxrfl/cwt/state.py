"""What the relay of cyclical weight transfer carries: its plan, its state between cycles, one cycle's attempt.

:class:`cxrfl.cwt.server.CWTServer` keeps :class:`RelayPlan` and :class:`RelayState` with the resume state
(:class:`cxrfl.common.resume.ResumeStore`) and rebuilds them from there for ``resume_from``; :class:`CycleRun`
lives for one attempt at a cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from cxrfl.common.io import to_numpy
from cxrfl.common.selection import EarlyStopping
from cxrfl.cwt.relay import Visit


@dataclass
class RelayPlan:
    """Who takes part and what each site does on its turn (fixed when the relay starts).

    Args:
        relay: the sites in their fixed order.
        classes: the model's outputs.
        visits: site -> its steps and learning rate.
        counts: site -> its answer to the counts task.
    """

    relay: list[str]
    classes: list[str]
    visits: dict[str, Visit]
    counts: dict[str, dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (kept with the resume state)."""
        return {
            "relay": self.relay,
            "classes": self.classes,
            "counts": self.counts,
            "visits": {s: asdict(v) for s, v in self.visits.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RelayPlan:
        """Rebuild from :meth:`to_dict`.

        Args:
            data: the saved dict.
        """
        return cls(
            list(data["relay"]),
            list(data["classes"]),
            {s: Visit(**v) for s, v in data["visits"].items()},
            {s: dict(c) for s, c in data["counts"].items()},
        )


@dataclass
class RelayState:
    """What the relay carries from one completed cycle to the next (and a resumed run restores).

    Args:
        cycle: the last completed cycle (0: none yet).
        weights: the model.
        optimizer: Adam's travelling state ({} with ``optimizer_state: reset``).
        iteration: optimiser steps taken so far over every visit (the learning-rate schedule's position).
        stopping: early stopping and the best cycle.
        best_weights: the best cycle's model (None: no cycle had a finite loss yet).
        history: one record per completed cycle (with its visits).
    """

    cycle: int
    weights: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    iteration: int
    stopping: EarlyStopping
    best_weights: dict[str, np.ndarray] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the resume store (its ``torch_save`` stores the arrays as tensors)."""
        return {
            "cycle": self.cycle,
            "weights": self.weights,
            "optimizer": self.optimizer,
            "iteration": self.iteration,
            "stopping": self.stopping.to_dict(),
            "best_weights": self.best_weights,
            "history": self.history,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RelayState:
        """Rebuild from :meth:`to_dict`.

        Args:
            data: the loaded resume state.
        """
        best = data["best_weights"]
        return cls(
            int(data["cycle"]),
            to_numpy(data["weights"]),
            to_numpy(data["optimizer"]),
            int(data["iteration"]),
            EarlyStopping.from_dict(data["stopping"]),
            to_numpy(best) if best is not None else None,
            list(data["history"]),
        )


@dataclass
class CycleRun:
    """One attempt at a cycle: the model as it goes from site to site."""

    cycle: int
    attempt: int
    order: list[str]
    weights: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    iteration: int
    trained: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    visits: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
