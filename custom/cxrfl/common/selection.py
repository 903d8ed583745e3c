"""Model selection and early stopping on a validation loss: the only copy, used by every method."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class EarlyStopping:
    """Track the lowest validation loss; stop after ``patience`` steps without improvement.

    A value improves when it is finite and below ``best - min_delta``; anything else (a smaller
    improvement, NaN) counts as a step without improvement.

    Args:
        patience: steps (rounds, cycles, epochs) without improvement before stopping (>= 1).
        min_delta: improvements smaller than this do not count (>= 0).
        best: the lowest loss so far (inf: none yet).
        best_step: the step of ``best`` (None: none yet).
        stale: steps since the last improvement.
    """

    patience: int
    min_delta: float = 0.0
    best: float = math.inf
    best_step: int | None = None
    stale: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"patience must be an integer >= 1, got {self.patience!r}")
        if not (self.min_delta >= 0):
            raise ValueError(f"min_delta must be >= 0, got {self.min_delta!r}")

    def update(self, loss: float | None, step: int) -> bool:
        """Consider the loss of the model of ``step``.

        Args:
            loss: its validation loss (None or NaN: no improvement).
            step: the step that produced the model.

        Returns:
            True when it is the new best model.
        """
        if loss is not None and math.isfinite(loss) and loss < self.best - self.min_delta:
            self.best, self.best_step, self.stale = float(loss), step, 0
            return True
        self.stale += 1
        return False

    @property
    def should_stop(self) -> bool:
        """``patience`` steps in a row without improvement."""
        return self.stale >= self.patience

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (kept with a resumable run's state)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EarlyStopping:
        """Rebuild from :meth:`to_dict`.

        Args:
            data: the saved dict.
        """
        return cls(**data)
