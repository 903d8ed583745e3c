"""Per-class AUROC (scikit-learn) and its summaries as the papers report them.

The statistics only the benchmarks report (bootstrap and t-intervals, paired tests) are in
:mod:`cxrfl.bench.intervals`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats
from sklearn.metrics import roc_auc_score


def _labels_2d(y_true: np.ndarray, y_score: np.ndarray, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    y_true = np.asarray(y_true, dtype=float)
    y_score = np.asarray(y_score, dtype=float)
    if y_true.ndim == 1 and n_classes == 1:
        y_true, y_score = y_true[:, None], y_score.reshape(-1, 1)
    if y_true.ndim != 2 or y_true.shape[1] != n_classes or y_score.shape != y_true.shape:
        raise ValueError(
            f"y_true {y_true.shape} and y_score {y_score.shape} must both be [n_samples, {n_classes}] "
            f"({n_classes} classes)"
        )
    return y_true, y_score


def per_class_auroc(
    y_true: np.ndarray,
    y_score: np.ndarray,
    classes: Sequence[str],
    mask: np.ndarray | None = None,
) -> dict[str, float | None]:
    """AUROC of each class over its known entries (``sklearn.metrics.roc_auc_score``).

    Args:
        y_true: [n, K] labels in {0, 1}; NaN marks an unknown label when ``mask`` is None.
        y_score: [n, K] scores (logits or probabilities).
        classes: the K class names, in column order.
        mask: [n, K], nonzero where the label is known (default: where ``y_true`` is not NaN).

    Returns:
        class -> AUROC, or None ("not defined") when the known entries of a class hold only one
        label value (never 0.5).
    """
    classes = list(classes)
    y_true, y_score = _labels_2d(y_true, y_score, len(classes))
    known = ~np.isnan(y_true) if mask is None else np.asarray(mask).reshape(y_true.shape) != 0
    out: dict[str, float | None] = {}
    for j, name in enumerate(classes):
        t, s = y_true[known[:, j], j], y_score[known[:, j], j]
        if not np.isin(t, (0.0, 1.0)).all():
            raise ValueError(f"class {name!r}: known labels must be 0 or 1, found {sorted(set(t) - {0.0, 1.0})[:5]}")
        out[name] = float(roc_auc_score(t, s)) if np.unique(t).size == 2 else None
    return out


def _mean_sd(values: Sequence[float], unknown: Sequence[str] = ()) -> dict[str, Any]:
    n = len(values)
    if unknown:  # the model does not predict every class of the set: not defined (the papers' "-")
        return {"mean": None, "sd": None, "n": n, "unknown": sorted(unknown)}
    return {
        "mean": float(np.mean(values)) if n else None,
        "sd": float(np.std(values, ddof=1)) if n >= 2 else None,
        "n": n,
    }


def summarise_auroc(
    aurocs: Mapping[str, float | None],
    *,
    shared: Iterable[str] | None = None,
    model_classes: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Mean +- SD of the defined per-class AUROCs, optionally split into shared and unique classes.

    SD is the sample standard deviation (ddof=1, as the papers report); None when fewer than two
    classes are defined (mean None when none is). A class whose test labels hold one value only
    is left out of the statistics. With ``model_classes``, a set of classes that holds a class
    the model does not predict has no mean and no SD (None: "not defined", as in the papers),
    whatever the other classes score; that set's summary lists those classes under ``unknown``.

    Args:
        aurocs: class -> AUROC or None (undefined, left out of the statistics).
        shared: the classes that several sites have; the rest are "unique".
        model_classes: the classes the evaluated model predicts (None: all of ``aurocs``).

    Returns:
        ``{'mean', 'sd', 'n', 'undefined': [classes]}`` (plus ``'unknown'`` when the model lacks
        a class) and, when ``shared`` is given, ``'shared'`` and ``'unique'``: ``{'mean', 'sd',
        'n'[, 'unknown']}`` each.
    """
    defined = {c: float(v) for c, v in aurocs.items() if v is not None and not math.isnan(v)}
    known = None if model_classes is None else set(model_classes)

    def unknown_in(classes: Iterable[str]) -> list[str]:
        return [] if known is None else [c for c in classes if c not in known]

    summary = _mean_sd(list(defined.values()), unknown_in(aurocs))
    summary["undefined"] = sorted(c for c in aurocs if c not in defined)
    if shared is not None:
        shared_set = set(shared)
        for name, inside in (("shared", True), ("unique", False)):
            group = [c for c in aurocs if (c in shared_set) == inside]
            summary[name] = _mean_sd([defined[c] for c in group if c in defined], unknown_in(group))
    return summary


def fast_auroc(y_true: np.ndarray, y_score: np.ndarray, *, axis: int = -1) -> np.ndarray:
    """AUROC along ``axis`` by the Mann-Whitney rank sum (ties get average ranks): the same value
    as ``sklearn.metrics.roc_auc_score``, vectorised over the other axes (bootstrap resamples).

    Args:
        y_true: labels in {0, 1}.
        y_score: scores, same shape.
        axis: the sample axis.

    Returns:
        the AUROCs; NaN where a slice holds one label value only.
    """
    y_true = np.moveaxis(np.asarray(y_true, dtype=float), axis, -1)
    y_score = np.moveaxis(np.asarray(y_score, dtype=float), axis, -1)
    ranks = stats.rankdata(y_score, axis=-1)
    n_pos = y_true.sum(-1)
    n_neg = y_true.shape[-1] - n_pos
    with np.errstate(divide="ignore", invalid="ignore"):
        auc = ((ranks * y_true).sum(-1) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
    return np.where((n_pos > 0) & (n_neg > 0), auc, np.nan)
