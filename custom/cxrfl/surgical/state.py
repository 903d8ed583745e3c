"""What a surgical-aggregation run holds between rounds, and what a resumed run loads.

:class:`cxrfl.surgical.server.SurgicalServer` keeps one :class:`RunState`, saves it (with the
settings) after the warm-up, every completed round and every late join
(:class:`cxrfl.common.resume.ResumeStore`), and rebuilds it from there for ``resume_from``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cxrfl.common.io import to_numpy
from cxrfl.common.selection import EarlyStopping


@dataclass
class RunState:
    """What a run holds between rounds, and what a resumed run loads.

    Args:
        round: the last completed round (0: the warm-up).
        params: the global model after it (``local`` heads: the feature extractor only).
        classes: the global head's class order ([] for ``local`` heads).
        announced: site -> the classes it announced in the warm-up (the sites of the run).
        stopper: model selection and early stopping.
        best_params: the selected model so far (None: none scored yet).
        curve: one point per scored model (:func:`cxrfl.surgical.records.curve_point`).
        run_key: names the sites' state across resumed runs (the first run's id).
        joined: site -> the round in whose exchange it warmed up late (it trains from the next round;
            sites of the warm-up: absent).
    """

    round: int
    params: dict[str, np.ndarray]
    classes: list[str]
    announced: dict[str, list[str]]
    stopper: EarlyStopping
    best_params: dict[str, np.ndarray] | None
    curve: list[dict[str, Any]]
    run_key: str
    joined: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the resume store."""
        return {
            "round": self.round,
            "params": self.params,
            "classes": self.classes,
            "announced": self.announced,
            "stopper": self.stopper.to_dict(),
            "best_params": self.best_params,
            "curve": self.curve,
            "run_key": self.run_key,
            "joined": self.joined,
        }

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> RunState:
        """Rebuild from :meth:`to_dict`.

        Args:
            saved: the loaded resume state.
        """
        best = saved.get("best_params")
        return cls(
            int(saved["round"]),
            to_numpy(saved["params"]),
            list(saved["classes"]),
            dict(saved["announced"]),
            EarlyStopping.from_dict(saved["stopper"]),
            None if best is None else to_numpy(best),
            list(saved.get("curve") or []),
            str(saved["run_key"]),
            dict(saved.get("joined") or {}),
        )
