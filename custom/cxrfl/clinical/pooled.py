"""Pooled AUROC, sensitivity and specificity computed by the server from merged score counts.

Only :class:`~cxrfl.clinical.counts.ScoreCounts` (positives and negatives per bin) reach the
server; every statistic here is a function of those counts. The AUROC is the Mann-Whitney
statistic with a positive and a negative of the same bin counted as half a correct pair (what
``sklearn.metrics.roc_auc_score`` does for tied scores); its interval is DeLong's, the variance
computed from the counts (every score of a bin is a tie), with a normal (Wald) interval clipped
to [0, 1]. Sensitivity and specificity are read at bin edges ("positive" means score >=
threshold) with Wilson score intervals.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import expit, logit
from scipy.stats import binomtest, norm

from cxrfl.clinical.counts import ScoreCounts


def _z(level: float) -> float:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    return float(norm.ppf(0.5 + level / 2))


@dataclass(frozen=True)
class Auroc:
    """A pooled AUROC.

    Args:
        value: the Mann-Whitney AUROC (ties within a bin count half).
        low: lower end of the DeLong interval.
        high: upper end.
        se: DeLong's standard error.
        binning_bound: largest possible difference from the AUROC of the raw scores
            (``sum_k pos_k neg_k / (2 P N)``: the pairs a bin cannot order).
        n_pos: positives pooled.
        n_neg: negatives pooled.
    """

    value: float
    low: float
    high: float
    se: float
    binning_bound: float
    n_pos: int
    n_neg: int

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict."""
        return dataclasses.asdict(self)


def pooled_auroc(counts: ScoreCounts, *, level: float = 0.95) -> Auroc:
    """AUROC of the pooled scores from their counts, with DeLong's interval.

    Args:
        counts: merged counts of one class (positives and negatives both present).
        level: confidence level of the interval.
    """
    pos, neg = counts.positives.astype(float), counts.negatives.astype(float)
    p, n = pos.sum(), neg.sum()
    if p == 0 or n == 0:
        raise ValueError(f"AUROC needs positives and negatives, got {int(p)} and {int(n)}")
    v10 = (np.cumsum(neg) - neg / 2) / n  # each positive's share of negatives below it (ties half)
    v01 = (p - np.cumsum(pos) + pos / 2) / p  # each negative's share of positives above it
    auc = float((pos * v10).sum() / p)
    s10 = (pos * (v10 - auc) ** 2).sum() / max(p - 1, 1)
    s01 = (neg * (v01 - auc) ** 2).sum() / max(n - 1, 1)
    se = float(np.sqrt(s10 / p + s01 / n))
    half = _z(level) * se
    return Auroc(
        auc, max(auc - half, 0.0), min(auc + half, 1.0), se, float((pos * neg).sum() / (2 * p * n)), int(p), int(n)
    )


@dataclass(frozen=True)
class Gap:
    """A difference of two AUROCs of disjoint groups (subgroups: different patients).

    Args:
        value: first minus second.
        low: lower end of its interval (Wald; the two DeLong variances add).
        high: upper end.
    """

    value: float
    low: float
    high: float


def auroc_gap(first: Auroc, second: Auroc, *, level: float = 0.95) -> Gap:
    """``first - second`` with its interval, for independent groups.

    Args:
        first: one group's AUROC.
        second: the other's.
        level: confidence level.
    """
    half = _z(level) * float(np.hypot(first.se, second.se))
    diff = first.value - second.value
    return Gap(diff, diff - half, diff + half)


@dataclass(frozen=True)
class Rate:
    """A proportion with its Wilson score interval.

    Args:
        value: ``k / n``.
        low: lower end.
        high: upper end.
        k: successes.
        n: trials.
    """

    value: float
    low: float
    high: float
    k: int
    n: int


def wilson(k: int, n: int, *, level: float = 0.95) -> Rate:
    """``k / n`` with its Wilson score interval (``scipy.stats.binomtest``).

    Args:
        k: successes.
        n: trials (>= 1).
        level: confidence level.
    """
    ci = binomtest(int(k), int(n)).proportion_ci(level, method="wilson")
    return Rate(k / n, float(ci.low), float(ci.high), int(k), int(n))


@dataclass(frozen=True)
class SensSpec:
    """Sensitivity and specificity at one threshold (positive when score >= threshold).

    Args:
        threshold: the probability threshold (a bin edge).
        logit_threshold: the same threshold as a logit (exact; a site may compare logits).
        sensitivity: positives at or above it.
        specificity: negatives below it.
    """

    threshold: float
    logit_threshold: float
    sensitivity: Rate
    specificity: Rate

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict."""
        return dataclasses.asdict(self)


def at_cut(counts: ScoreCounts, cut: int, *, level: float = 0.95) -> SensSpec:
    """Sensitivity and specificity when bins ``cut`` and above count as positive.

    Args:
        counts: merged counts of one class.
        cut: first positive bin, 1 ... ``bins.n + 1`` (its lower edge is the threshold).
        level: confidence level of the intervals.
    """
    if not 1 <= cut <= counts.bins.n + 1:
        raise ValueError(f"cut must be in 1 ... {counts.bins.n + 1}, got {cut}")
    edge = float(counts.bins.edges()[cut - 1])
    tp, tn = int(counts.positives[cut:].sum()), int(counts.negatives[:cut].sum())
    return SensSpec(
        float(expit(edge)), edge, wilson(tp, counts.n_pos, level=level), wilson(tn, counts.n_neg, level=level)
    )


def at_threshold(counts: ScoreCounts, threshold: float, *, level: float = 0.95) -> SensSpec:
    """Sensitivity and specificity at the bin edge nearest (in logits) to a probability threshold.

    Args:
        counts: merged counts of one class.
        threshold: probability in (0, 1); the result names the edge actually used.
        level: confidence level of the intervals.
    """
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be a probability in (0, 1), got {threshold}")
    cut = int(np.argmin(np.abs(counts.bins.edges() - logit(threshold)))) + 1
    return at_cut(counts, cut, level=level)


def roc_curve(counts: ScoreCounts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ROC points from the counts, as ``sklearn.metrics.roc_curve`` gives them for binned scores.

    Args:
        counts: merged counts of one class.

    Returns:
        (fpr, tpr, thresholds): from (0, 0) to (1, 1), one point per non-empty bin; the
        threshold (probability) is the lower edge of the lowest bin counted positive (``inf``
        first, 0 for the open bottom bin). The trapezoid area equals :func:`pooled_auroc`.
    """
    tp = np.concatenate([[0], np.cumsum(counts.positives[::-1])])
    fp = np.concatenate([[0], np.cumsum(counts.negatives[::-1])])
    lower = np.concatenate([[-np.inf], counts.bins.edges()])  # lower edge of bin b is lower[b]
    thresholds = np.concatenate([[np.inf], expit(lower[::-1])])
    keep = np.concatenate([[True], (np.diff(tp) > 0) | (np.diff(fp) > 0)])
    return fp[keep] / fp[-1], tp[keep] / tp[-1], thresholds[keep]
