"""Metrics of a binary detector (one rare class) that flagging every image cannot game.

F1 alone rewards a detector that flags everything: on a balanced test set (as FedFew's UC test
sets are) flagging all images scores F1 ``2p / (1 + p) = 0.667``. So a detector is judged by

* the AUROC of its continuous score, with a percentile bootstrap interval over the test images
  (``scipy.stats.bootstrap``; the rank-sum AUROC :func:`cxrfl.nn.metrics.fast_auroc`);
* balanced accuracy and Matthews' correlation at a decision fixed before testing (both 0.5 and 0
  for "flag everything" and for "flag nothing", whatever the prevalence);
* F1, precision and recall beside the F1 of flagging everything on the same images, and the same
  at a realistic prevalence (the negatives re-weighted so that positives are ``prevalence`` of
  the weight: a balanced test set overstates precision).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import stats
from sklearn.metrics import (
    accuracy_score,
    balanced_accuracy_score,
    f1_score,
    matthews_corrcoef,
    precision_score,
    recall_score,
)

from cxrfl.nn.metrics import fast_auroc


def flag_all_f1(prevalence: float) -> float:
    """F1 of flagging every image when a share ``prevalence`` of them is positive (precision
    ``prevalence``, recall 1)."""
    return 2 * prevalence / (1 + prevalence)


def auroc_interval(
    y_true: np.ndarray, score: np.ndarray, *, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the AUROC over the images (resamples with one label value
    are left out); None when a label value is missing.

    Args:
        y_true: [n] labels in {0, 1}.
        score: [n] detection scores.
        n_boot: resamples.
        alpha: 1 - confidence level.
        seed: seed of the resampling (same seed, same interval).
    """
    y_true = np.asarray(y_true, dtype=float)
    if np.unique(y_true).size < 2:
        return None
    res = stats.bootstrap(
        (y_true, np.asarray(score, dtype=float)),
        lambda y, s, axis: fast_auroc(y, s, axis=axis),
        paired=True,
        vectorized=True,
        n_resamples=n_boot,
        confidence_level=1 - alpha,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    dist = res.bootstrap_distribution
    dist = dist[~np.isnan(dist)]
    if dist.size == 0:
        return None
    lower, upper = np.quantile(dist, [alpha / 2, 1 - alpha / 2])
    return float(lower), float(upper)


def _at_decision(y: np.ndarray, pred: np.ndarray, weight: np.ndarray | None) -> dict[str, float]:
    return {
        "f1": float(f1_score(y, pred, sample_weight=weight, zero_division=0)),
        "precision": float(precision_score(y, pred, sample_weight=weight, zero_division=0)),
        "recall": float(recall_score(y, pred, sample_weight=weight, zero_division=0)),
    }


def detection_metrics(
    y_true: np.ndarray,
    score: np.ndarray,
    predicted: np.ndarray,
    *,
    prevalence: float | None = None,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Every metric of one detector on one test set (NaN labels are left out).

    Args:
        y_true: [n] labels: 1, 0 or NaN (unknown).
        score: [n] the detector's continuous score (higher: more likely positive).
        predicted: [n] its decisions (bool), fixed before testing.
        prevalence: the share of positives to report F1 and precision at (None: only the test
            set's own).
        n_boot: bootstrap resamples of the AUROC interval.
        seed: seed of the bootstrap.

    Returns:
        ``n``, ``n_positive``, ``n_predicted``; ``auroc`` and ``auroc_ci`` (None when a label
        value is missing); ``balanced_accuracy``, ``mcc``, ``specificity``, ``accuracy``; ``f1``, ``precision``,
        ``recall`` and ``f1_flag_all`` on the test set; with ``prevalence``, ``at_prevalence``:
        ``prevalence``, ``f1``, ``precision``, ``recall``, ``f1_flag_all``.
    """
    y = np.asarray(y_true, dtype=float).ravel()
    s = np.asarray(score, dtype=float).ravel()
    p = np.asarray(predicted).astype(bool).ravel()
    if not y.shape == s.shape == p.shape:
        raise ValueError(f"labels {y.shape}, scores {s.shape} and decisions {p.shape} differ in length")
    known = ~np.isnan(y)
    y, s, p = y[known].astype(int), s[known], p[known]
    n, n_pos = int(y.size), int(y.sum())
    out: dict[str, Any] = {"n": n, "n_positive": n_pos, "n_predicted": int(p.sum())}
    both = 0 < n_pos < n
    out["auroc"] = float(fast_auroc(y, s)) if both else None
    out["auroc_ci"] = auroc_interval(y, s, n_boot=n_boot, seed=seed) if both else None
    out["balanced_accuracy"] = float(balanced_accuracy_score(y, p)) if both else None
    out["mcc"] = float(matthews_corrcoef(y, p)) if both else None
    out["specificity"] = float((~p[y == 0]).mean()) if n_pos < n else None
    out["accuracy"] = float(accuracy_score(y, p)) if n else None  # flattered by a balanced set: shown, never judged
    out.update(_at_decision(y, p, None) if n else {"f1": None, "precision": None, "recall": None})
    out["f1_flag_all"] = flag_all_f1(n_pos / n) if n else None
    if prevalence is not None:
        if not 0 < prevalence < 1:
            raise ValueError(f"prevalence must be in (0, 1), got {prevalence}")
        at: dict[str, Any] = {"prevalence": prevalence, "f1_flag_all": flag_all_f1(prevalence)}
        if both:
            # negatives weighted so that positives carry `prevalence` of the total weight
            w_neg = n_pos * (1 - prevalence) / (prevalence * (n - n_pos))
            at.update(_at_decision(y, p, np.where(y == 1, 1.0, w_neg)))
        out["at_prevalence"] = at
    return out
