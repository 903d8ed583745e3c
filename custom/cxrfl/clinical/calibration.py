"""Per-class calibration maps and calibration error, fitted and measured from score counts.

Only :class:`~cxrfl.clinical.counts.ScoreCounts` reach the server. A map is fitted to the
pooled validation counts of one class by weighted logistic regression: every bin stands for its
scores at its centre logit, its positives and negatives as weights (Platt scaling:
``sigmoid(slope * logit + intercept)``; temperature scaling: intercept 0, ``slope = 1 / T > 0``).
A map is kept only where it fits the counts significantly better than the raw scores
(:func:`supported_calibration`: a likelihood-ratio test against the identity map), so noise in a small
or already calibrated split is never fitted. The map travels as three numbers (:class:`CalibrationMap`,
a settings section) and a site applies it to its own scores (:meth:`CalibrationMap.apply`). Expected
calibration error and the reliability diagram pool the bins into equal-width probability bins, each
bin's scores taken at its centre, before or after a map; the scores of the two open bins are taken at
their inner edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from scipy.optimize import minimize
from scipy.special import expit, logit
from scipy.stats import chi2

from cxrfl.clinical.counts import ScoreCounts
from cxrfl.common.config import Config

KINDS = ("identity", "platt", "temperature")
_LOGIT_CLIP = 40.0  # probabilities 0 and 1 are read as these logits (float64 sigmoid saturates at ~37)


@dataclass(frozen=True)
class CalibrationMap(Config):
    """``p -> sigmoid(slope * logit(p) + intercept)`` for one class.

    Args:
        kind: ``platt``, ``temperature`` (intercept 0) or ``identity`` (no change).
        slope: multiplies the logit (``1 / T`` for temperature scaling).
        intercept: added to it.
    """

    SECTION: ClassVar[str] = "calibration"
    kind: str = field(default="identity", metadata={"choices": KINDS})
    slope: float = 1.0
    intercept: float = 0.0

    def apply_logits(self, logits: np.ndarray) -> np.ndarray:
        """Calibrated probabilities of logits.

        Args:
            logits: the model's logits.
        """
        return expit(self.slope * np.asarray(logits, dtype=float) + self.intercept)

    def apply(self, scores: np.ndarray) -> np.ndarray:
        """Calibrated probabilities of probabilities.

        Args:
            scores: probabilities in [0, 1].
        """
        with np.errstate(divide="ignore"):
            z = logit(np.asarray(scores, dtype=float))
        return self.apply_logits(np.clip(z, -_LOGIT_CLIP, _LOGIT_CLIP))


def _weights(counts: ScoreCounts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The used bins' centre logits and their positives and negatives as float weights."""
    used = (counts.positives + counts.negatives) > 0
    return counts.bins.centres()[used], counts.positives[used].astype(float), counts.negatives[used].astype(float)


def log_loss(counts: ScoreCounts, calibration: CalibrationMap | None = None) -> float:
    """Summed negative log-likelihood of a class's counts under a map (None: the raw scores).

    Args:
        counts: counts of one class.
        calibration: the map applied to every bin's centre.
    """
    x, wp, wn = _weights(counts)
    m = calibration or CalibrationMap()
    z = m.slope * x + m.intercept
    return float((wp * np.logaddexp(0, -z) + wn * np.logaddexp(0, z)).sum())


def fit_calibration(counts: ScoreCounts, kind: str = "platt") -> CalibrationMap:
    """Fit a map to a class's pooled validation counts (weighted logistic regression).

    Args:
        counts: merged validation counts of one class.
        kind: ``platt`` or ``temperature``.
    """
    if kind not in ("platt", "temperature"):
        raise ValueError(f"kind must be 'platt' or 'temperature', got {kind!r}")
    x, wp, wn = _weights(counts)
    total = wp.sum() + wn.sum()
    platt = kind == "platt"

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        z = theta[0] * x + (theta[1] if platt else 0.0)
        nll = (wp * np.logaddexp(0, -z) + wn * np.logaddexp(0, z)).sum() / total
        dz = ((wp + wn) * expit(z) - wp) / total
        return float(nll), np.array([(dz * x).sum(), dz.sum()][: len(theta)])

    start, bounds = (np.array([1.0, 0.0]), None) if platt else (np.array([1.0]), [(1e-6, None)])
    fit = minimize(
        loss, start, jac=True, method="L-BFGS-B", bounds=bounds, options={"gtol": 1e-10, "ftol": 1e-14, "maxiter": 500}
    )
    if not fit.success:
        raise ValueError(f"{kind} calibration did not converge: {fit.message}")
    return CalibrationMap(kind=kind, slope=float(fit.x[0]), intercept=float(fit.x[1]) if platt else 0.0)


def supported_calibration(
    counts: ScoreCounts, kind: str = "platt", *, alpha: float = 0.05
) -> tuple[CalibrationMap, float]:
    """The fitted map where it beats the raw scores significantly, else the identity map.

    The likelihood-ratio statistic ``2 * (NLL(raw) - NLL(map))`` is referred to a chi-squared law with
    one degree of freedom per fitted parameter (2 for Platt, 1 for temperature).

    Args:
        counts: validation counts of one class.
        kind: ``platt`` or ``temperature``.
        alpha: the test's level (1: keep every fitted map).

    Returns:
        the map kept and the test's p-value.

    Raises:
        ValueError: the fit did not converge.
    """
    fitted = fit_calibration(counts, kind)
    statistic = max(0.0, 2 * (log_loss(counts) - log_loss(counts, fitted)))
    p = float(chi2.sf(statistic, 2 if kind == "platt" else 1))
    return (fitted if p <= alpha else CalibrationMap()), p


@dataclass(frozen=True)
class Reliability:
    """A reliability diagram and its expected calibration error.

    Args:
        edges: [m + 1] probability edges of the diagram's bins (equal width on [0, 1]).
        count: [m] scores per bin.
        mean_predicted: [m] mean predicted probability per bin (NaN where empty).
        observed: [m] fraction of positives per bin (NaN where empty).
        ece: ``sum_b count_b / N * |observed_b - mean_predicted_b|``.
    """

    edges: np.ndarray
    count: np.ndarray
    mean_predicted: np.ndarray
    observed: np.ndarray
    ece: float

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict (None for an empty bin's values)."""

        def plain(a: np.ndarray) -> list[Any]:
            return [None if np.isnan(v) else float(v) for v in a.astype(float)]

        return {
            "edges": self.edges.tolist(),
            "count": self.count.tolist(),
            "mean_predicted": plain(self.mean_predicted),
            "observed": plain(self.observed),
            "ece": self.ece,
        }


def reliability(counts: ScoreCounts, calibration: CalibrationMap | None = None, *, n_bins: int = 15) -> Reliability:
    """Reliability diagram and ECE of a class's counts, before (None) or after a map.

    Args:
        counts: counts of one class (one site's test split, or merged).
        calibration: the map applied to every bin's centre (None: the raw scores).
        n_bins: equal-width probability bins of the diagram.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    prob = (calibration or CalibrationMap()).apply_logits(counts.bins.centres())
    which = np.clip((prob * n_bins).astype(int), 0, n_bins - 1)
    size = counts.positives + counts.negatives
    count = np.bincount(which, weights=size, minlength=n_bins)
    predicted = np.bincount(which, weights=size * prob, minlength=n_bins)
    positives = np.bincount(which, weights=counts.positives, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_predicted, observed = predicted / count, positives / count
    ece = float(np.abs(positives - predicted).sum() / count.sum())
    return Reliability(np.linspace(0, 1, n_bins + 1), count.astype(np.int64), mean_predicted, observed, ece)
