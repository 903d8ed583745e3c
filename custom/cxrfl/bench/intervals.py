"""The statistics the benchmarks report on AUROCs, from scipy.

Bootstrap replicates and percentile intervals of per-class AUROC (the Mann-Whitney rank sum,
vectorised over resamples), t-intervals (``scipy.stats.t``), paired t-tests
(``scipy.stats.ttest_rel``, with the interval of the mean difference), Wilcoxon signed-rank tests
(``scipy.stats.wilcoxon``) and Shapiro-Wilk normality checks (``scipy.stats.shapiro``); effect
sizes are the mean paired difference with its interval and Cohen's d_z (mean difference over
the standard deviation of the differences). A family of tests is adjusted by Holm's step-down
method, and the power of a paired t-test (the noncentral t, ``scipy.stats.nct``) gives the
smallest difference a comparison could detect at its n. Per-class AUROC itself is
:func:`cxrfl.nn.metrics.per_class_auroc`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import numpy as np
from scipy import optimize, stats
from sklearn.metrics import roc_auc_score

K = TypeVar("K")


def bootstrap_auroc_ci(
    y_true: np.ndarray,
    y_score: np.ndarray,
    *,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of one class's AUROC.

    Resamples (with replacement) that draw a single label value are skipped.

    Args:
        y_true: [n] labels in {0, 1}, both values present.
        y_score: [n] scores.
        n_boot: number of resamples.
        alpha: 1 - confidence level (0.05: 95 % interval).
        seed: seed of ``numpy.random.default_rng`` (same seed, same interval).

    Returns:
        (lower, upper).
    """
    y_true = np.asarray(y_true, dtype=float).ravel()
    y_score = np.asarray(y_score, dtype=float).ravel()
    if y_true.shape != y_score.shape:
        raise ValueError(f"y_true {y_true.shape} and y_score {y_score.shape} differ in length")
    if not np.isin(y_true, (0.0, 1.0)).all() or np.unique(y_true).size != 2:
        raise ValueError("y_true must hold labels 0 and 1, both present (AUROC is undefined otherwise)")
    if n_boot < 1 or not 0 < alpha < 1:
        raise ValueError(f"need n_boot >= 1 and 0 < alpha < 1, got n_boot={n_boot}, alpha={alpha}")
    rng = np.random.default_rng(seed)
    n = y_true.size
    scores = []
    for _ in range(n_boot):
        idx = rng.integers(0, n, n)
        t = y_true[idx]
        if t.min() != t.max():
            scores.append(roc_auc_score(t, y_score[idx]))
    if not scores:
        raise ValueError("no bootstrap resample held both labels; too few samples")
    lower, upper = np.quantile(scores, [alpha / 2, 1 - alpha / 2])
    return float(lower), float(upper)


def bootstrap_aurocs(
    y_true: np.ndarray,
    y_score: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    n_boot: int = 1000,
    seed: int = 0,
) -> np.ndarray:
    """Bootstrap replicates of every class's AUROC, one resample of the images for all classes.

    The resample indices are those of :func:`bootstrap_auroc_ci` with the same seed, so one
    class's column gives that function's interval. Rows are shared by the classes, so a mean over
    classes per row is a bootstrap replicate of the mean AUROC.

    Args:
        y_true: [n, K] labels in {0, 1}; NaN marks unknown entries when ``mask`` is None.
        y_score: [n, K] scores.
        mask: [n, K], nonzero where the label is known.
        n_boot: number of resamples.
        seed: seed of ``numpy.random.default_rng``.

    Returns:
        [n_boot, K] AUROCs; NaN where a resample holds one label value of a class only.
    """
    y_true = np.asarray(y_true, dtype=float)
    y_score = np.asarray(y_score, dtype=float)
    if y_true.ndim == 1:
        y_true, y_score = y_true[:, None], y_score.reshape(-1, 1)
        mask = None if mask is None else np.asarray(mask).reshape(-1, 1)
    if y_true.shape != y_score.shape or y_true.ndim != 2:
        raise ValueError(f"y_true {y_true.shape} and y_score {y_score.shape} must both be [n_samples, n_classes]")
    known = ~np.isnan(y_true) if mask is None else np.asarray(mask).reshape(y_true.shape) != 0
    if n_boot < 1:
        raise ValueError(f"need n_boot >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    n, k = y_true.shape
    idx = np.stack([rng.integers(0, n, n) for _ in range(n_boot)])  # [B, n]
    out = np.full((n_boot, k), np.nan)
    for j in range(k):
        kn = known[:, j]
        t = np.where(kn, np.nan_to_num(y_true[:, j]), 0.0)
        # unknown entries rank below every known one; their count per resample is subtracted
        s = np.where(kn, y_score[:, j], -np.inf)
        tb, sb, kb = t[idx], s[idx], kn[idx]
        n_unknown = (~kb).sum(1)
        ranks = stats.rankdata(sb, axis=1)
        n_pos = tb.sum(1)
        n_neg = kb.sum(1) - n_pos
        with np.errstate(divide="ignore", invalid="ignore"):
            auc = ((ranks * tb).sum(1) - n_pos * n_unknown - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
        out[:, j] = np.where((n_pos > 0) & (n_neg > 0), auc, np.nan)
    return out


def percentile_ci(replicates: np.ndarray, alpha: float = 0.05) -> tuple[float, float] | None:
    """Percentile interval of bootstrap replicates, NaN replicates left out (None if all are NaN).

    Args:
        replicates: 1-D replicates.
        alpha: 1 - confidence level.
    """
    r = np.asarray(replicates, dtype=float).ravel()
    r = r[~np.isnan(r)]
    if r.size == 0:
        return None
    lower, upper = np.quantile(r, [alpha / 2, 1 - alpha / 2])
    return float(lower), float(upper)


def paired_ttest(a: Mapping[str, float | None], b: Mapping[str, float | None]) -> dict[str, Any]:
    """Paired t-test (``scipy.stats.ttest_rel``) of two methods' per-class AUROCs.

    Args:
        a: class -> AUROC of method A (None: undefined).
        b: class -> AUROC of method B.

    Returns:
        ``{'t', 'p', 'n', 'shapiro_p', 'classes'}`` over the classes defined in both (sorted);
        t and p are None when n < 2 or the differences are all equal; ``shapiro_p``
        (``scipy.stats.shapiro`` on a - b, a normality check) is None when n < 3 or the
        differences are all equal.
    """

    def ok(v: float | None) -> bool:
        return v is not None and not math.isnan(v)

    common = sorted(c for c in a if c in b and ok(a[c]) and ok(b[c]))
    x = np.array([a[c] for c in common], dtype=float)
    y = np.array([b[c] for c in common], dtype=float)
    diff = x - y
    n = len(common)
    varies = n >= 2 and np.ptp(diff) > 0
    result: dict[str, Any] = {"t": None, "p": None, "n": n, "shapiro_p": None, "classes": common}
    if varies:
        test = stats.ttest_rel(x, y)
        result["t"], result["p"] = float(test.statistic), float(test.pvalue)
    if varies and n >= 3:
        result["shapiro_p"] = float(stats.shapiro(diff).pvalue)
    return result


_TIE = 1e-12
"""Differences closer than this count as equal (float noise of equal AUROCs averaged in another order)."""


def _defined(v: float | None) -> bool:
    return v is not None and not math.isnan(v)


def finite_mean(values: Any) -> float | None:
    """The mean of the finite values (None / NaN / inf left out); None when there is none.

    Args:
        values: numbers or None.
    """
    finite = [float(v) for v in values if v is not None and np.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def mean_ci(values: Iterable[float | None], alpha: float = 0.05) -> dict[str, Any]:
    """Mean, sample SD and Student-t confidence interval of the mean (``scipy.stats.t.interval``).

    Args:
        values: the values (None / NaN left out), e.g. one mean AUROC per seed.
        alpha: 1 - confidence level.

    Returns:
        ``{'mean', 'sd', 'n', 'ci'}``: mean None when no value is defined; sd and ci None below two
        values; ci ``(mean, mean)`` when every value is the same.
    """
    defined: list[float] = [float(v) for v in values if v is not None and not math.isnan(v)]
    x = np.asarray(defined, dtype=float)
    n = int(x.size)
    if n == 0:
        return {"mean": None, "sd": None, "n": 0, "ci": None}
    mean = float(x.mean())
    if n < 2:
        return {"mean": mean, "sd": None, "n": 1, "ci": None}
    sd = float(x.std(ddof=1))
    if sd == 0:
        return {"mean": mean, "sd": 0.0, "n": n, "ci": (mean, mean)}
    lower, upper = stats.t.interval(1 - alpha, n - 1, loc=mean, scale=sd / math.sqrt(n))
    return {"mean": mean, "sd": sd, "n": n, "ci": (float(lower), float(upper))}


def paired_comparison(
    a: Mapping[Any, float | None],
    b: Mapping[Any, float | None],
    alpha: float = 0.05,
) -> dict[str, Any]:
    """Paired comparison of A against B over the keys both define (classes, or seeds).

    Args:
        a: key -> value of A (e.g. per-class AUROC averaged over seeds, or mean AUROC per seed).
        b: key -> value of B.
        alpha: 1 - confidence level of the interval.

    Returns:
        ``n`` and ``keys`` (sorted), ``difference`` (mean of A - B), ``ci`` (its t-interval, from
        ``ttest_rel``), ``sd`` (of the differences), ``d_z`` (Cohen's d_z = difference / sd),
        ``t`` and ``p`` (paired t-test), ``wilcoxon_p`` (signed-rank test; zero differences
        dropped), ``shapiro_p`` (normality of the differences). Each is None where undefined:
        fewer than two pairs, differences that do not vary (t-test, interval, d_z), no non-zero
        difference (Wilcoxon), fewer than three pairs (Shapiro-Wilk).
    """
    keys = sorted((k for k in a if k in b and _defined(a[k]) and _defined(b[k])), key=str)
    x = np.array([a[k] for k in keys], dtype=float)
    y = np.array([b[k] for k in keys], dtype=float)
    diff = x - y
    n = len(keys)
    out: dict[str, Any] = {
        "n": n,
        "keys": keys,
        "difference": float(diff.mean()) if n else None,
        "ci": None,
        "sd": float(diff.std(ddof=1)) if n >= 2 else None,
        "d_z": None,
        "t": None,
        "p": None,
        "wilcoxon_p": None,
        "shapiro_p": None,
    }
    if n >= 2 and np.ptp(diff) > _TIE:
        test = stats.ttest_rel(x, y)
        lower, upper = test.confidence_interval(1 - alpha)
        out.update(
            t=float(test.statistic),
            p=float(test.pvalue),
            ci=(float(lower), float(upper)),
            d_z=float(diff.mean() / diff.std(ddof=1)),
        )
        if n >= 3:
            out["shapiro_p"] = float(stats.shapiro(diff).pvalue)
    if np.any(np.abs(diff) > _TIE):
        out["wilcoxon_p"] = float(stats.wilcoxon(x, y).pvalue)
    return out


def holm(pvalues: Mapping[K, float | None]) -> dict[K, float | None]:
    """Holm's step-down adjustment of a family of p-values (None: not tested, left out of the family).

    Args:
        pvalues: name -> p-value.
    """
    tested = sorted(((p, k) for k, p in pvalues.items() if p is not None), key=lambda pk: pk[0])
    out: dict[K, float | None] = dict.fromkeys(pvalues)
    running = 0.0
    for i, (p, k) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - i) * p))
        out[k] = running
    return out


def detectable_difference(n: int, sd: float | None, *, alpha: float = 0.05, power: float = 0.8) -> float | None:
    """The smallest mean paired difference a two-sided paired t-test detects with ``power`` at ``alpha``.

    Solves the noncentral t's power for the effect (in standard deviations of the differences,
    then scaled by ``sd``), so "no significant difference" can be told from "too few pairs to see one".

    Args:
        n: pairs.
        sd: standard deviation of the differences (None or 0: undefined).
        alpha: the test's level (for a Holm family, the first step's: 0.05 over the family's size).
        power: the probability of detecting the difference.

    Returns:
        the difference, or None with fewer than two pairs or no spread.
    """
    if n < 2 or not sd:
        return None
    df = n - 1
    critical = stats.t.ppf(1 - alpha / 2, df)

    def shortfall(effect: float) -> float:
        nc = effect * math.sqrt(n)
        upper = float(stats.nct.sf(critical, df, nc))
        lower = float(stats.nct.cdf(-critical, df, nc))  # the wrong-sign rejections: tiny, and NaN at times
        return (1.0 if math.isnan(upper) else upper) + (0.0 if math.isnan(lower) else lower) - power

    high = 100.0
    while shortfall(high) < 0 and high < 1e12:  # few pairs at a small level: many SDs
        high *= 10.0
    return float(optimize.brentq(shortfall, 1e-9, high)) * float(sd)
