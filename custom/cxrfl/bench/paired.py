"""Paired comparisons over seeds for the FedFew and CWT benchmarks' targets.

Two methods run with the same seed share the data draw and the initial weights, so their
difference per seed is the unit of comparison. :func:`cxrfl.bench.intervals.paired_comparison` gives
the mean difference, its 95 % t-interval, Cohen's d_z and the two-sided paired t-test (and the
Wilcoxon test); here a one-sided t-test against a margin is added (H1: the difference is above
``margin``, e.g. "at least 0.3 better" or "no worse than -0.01").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats

from cxrfl.bench.intervals import paired_comparison


def _one_sided(diffs: Sequence[float], margin: float) -> float | None:
    d = np.asarray(diffs, dtype=float)
    if len(d) < 2 or np.ptp(d) == 0:
        return None
    return float(stats.ttest_1samp(d, margin, alternative="greater").pvalue)


def paired(a: Mapping[str, float | None], b: Mapping[str, float | None], margin: float = 0.0) -> dict[str, Any]:
    """``b - a`` per seed defined in both.

    Args:
        a: seed -> value of the reference method.
        b: seed -> value of the compared method.
        margin: the one-sided test's null boundary (H1: mean difference > margin).

    Returns:
        :func:`cxrfl.bench.intervals.paired_comparison` of ``b`` against ``a`` (``difference``, ``ci``,
        ``sd``, ``d_z``, ``p`` two-sided, ``wilcoxon_p`` ...) plus ``per_seed`` (the differences),
        ``margin`` and ``p_one_sided``.
    """
    out = paired_comparison(b, a)
    diffs = [float(b[k]) - float(a[k]) for k in out["keys"]]
    return {**out, "per_seed": diffs, "margin": margin, "p_one_sided": _one_sided(diffs, margin)}


def against(values: Mapping[str, float | None], reference: float) -> dict[str, Any]:
    """One method's values per seed against a fixed reference (e.g. AUROC 0.5 or 0.7, F1 0.5).

    Args:
        values: seed -> value.
        reference: the value to beat (H1 of the one-sided test: mean > reference).

    Returns:
        :func:`paired` of ``values`` against the constant ``reference``, with ``reference``.
    """
    return {**paired({k: reference for k in values}, values), "reference": reference}


def format_stats(s: Mapping[str, Any], scale: float = 1.0, unit: str = "") -> str:
    """One line: mean difference [95 % CI], d_z, p-values, number of seeds.

    Args:
        s: output of :func:`paired` or :func:`against`.
        scale: multiply the differences (100: percentage points).
        unit: appended to the numbers.
    """
    if s.get("difference") is None:
        return "n/a"
    text = f"{scale * s['difference']:+.3g}{unit}"
    if s.get("ci"):
        text += f" [95% CI {scale * s['ci'][0]:+.3g}, {scale * s['ci'][1]:+.3g}{unit}]"
    if s.get("d_z") is not None:
        text += f", d_z {s['d_z']:.2f}"
    if s.get("p") is not None:
        text += f", p = {s['p']:.3g} (two-sided)"
    if s.get("p_one_sided") is not None:
        above = f", above {scale * s['margin']:+g}{unit}" if s.get("margin") else ""
        text += f", p = {s['p_one_sided']:.3g} (one-sided{above})"
    return text + f"; n = {s['n']} seed(s)"
