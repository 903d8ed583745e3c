"""Subgroup audit (issue 45 point 4): per class, AUROC and calibration by sex, age band and view,
pooled over the sites that label the class, from the same binned counts as the whole class.

A subgroup of a class travels as its own counting target named ``"<class>|<field>=<group>"``
(:func:`subgroup_names`), so the counting passes, the minimum cell size, the checks of each answer
and the second pass in fitted bins (:mod:`cxrfl.clinical.pooling`) apply to it unchanged. The
groups are fixed (:data:`GROUPS`): a site is asked about every group of its own classes and sends
nothing where it has fewer than ``min_cell`` positives or negatives there, or no such field. The
site computes membership from its own table (:func:`memberships`; columns ``sex``, ``age`` and
``view`` of :mod:`cxrfl.data.subgroups`); no per-image value leaves it.

Per class the report gives each group's pooled AUROC with its DeLong interval and ECE, and per field
the largest gap between two of its groups, with the interval of the difference of two independent
AUROCs (:func:`cxrfl.clinical.pooled.auroc_gap`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from cxrfl.clinical.calibration import reliability
from cxrfl.clinical.counts import SEPARATOR, ScoreCounts
from cxrfl.clinical.pooled import Auroc, auroc_gap, pooled_auroc

AGE_BANDS: tuple[tuple[float, float, str], ...] = (
    (0, 18, "<18"),
    (18, 40, "18-39"),
    (40, 60, "40-59"),
    (60, 80, "60-79"),
    (80, math.inf, "80+"),
)
"""Age bands in years: ``[low, high)``."""
GROUPS: dict[str, tuple[str, ...]] = {
    "sex": ("F", "M"),
    "age": tuple(b[2] for b in AGE_BANDS),
    "view": ("PA", "AP", "LL"),
}
"""Every field and its groups, in report order."""


def subgroup_names(classes: Sequence[str]) -> list[str]:
    """The counting targets of every group of ``classes`` (``"<class>|<field>=<group>"``)."""
    return [f"{c}{SEPARATOR}{f}={g}" for c in classes for f, groups in GROUPS.items() for g in groups]


def memberships(table: pd.DataFrame) -> dict[str, np.ndarray]:
    """Which rows of a site's table belong to each group (``"<field>=<group>"`` -> [n] bool); a field
    the table lacks gives no entry, a row with the value unknown belongs to no group of it.

    Args:
        table: the evaluated split, in the order its scores come (columns ``sex``, ``age``, ``view``).
    """
    out: dict[str, np.ndarray] = {}
    if "sex" in table:
        for g in GROUPS["sex"]:
            out[f"sex={g}"] = (table["sex"] == g).to_numpy()
    if "age" in table:
        age = pd.to_numeric(table["age"], errors="coerce").to_numpy(dtype=float)
        for low, high, g in AGE_BANDS:
            out[f"age={g}"] = (age >= low) & (age < high)  # NaN is in no band
    if "view" in table:
        for g in GROUPS["view"]:
            out[f"view={g}"] = (table["view"] == g).to_numpy()
    return out


def _group_entry(counts: ScoreCounts | None, level: float) -> dict[str, Any] | None:
    if counts is None or not counts.n_pos or not counts.n_neg:
        return None
    return {"auroc": pooled_auroc(counts, level=level).to_dict(), "ece": reliability(counts).ece}


def largest_gaps(groups: Mapping[str, Mapping[str, Any] | None], level: float) -> dict[str, Any]:
    """Per field with two or more pooled groups: the highest minus the lowest AUROC and its interval.

    Args:
        groups: ``"<field>=<group>"`` -> that group's entry (None: nothing pooled).
        level: confidence level.
    """
    out: dict[str, Any] = {}
    for field in GROUPS:
        have = {g: e for g, e in groups.items() if e is not None and g.startswith(f"{field}=")}
        if len(have) < 2:
            continue
        hi = max(have, key=lambda g: have[g]["auroc"]["value"])
        lo = min(have, key=lambda g: have[g]["auroc"]["value"])
        gap = auroc_gap(Auroc(**have[hi]["auroc"]), Auroc(**have[lo]["auroc"]), level=level)
        out[field] = {"higher": hi, "lower": lo, "value": gap.value, "low": gap.low, "high": gap.high}
    return out


def subgroup_report(
    classes: Sequence[str], merged: Mapping[str, ScoreCounts | None], *, level: float = 0.95
) -> dict[str, Any]:
    """Per class: each group's pooled AUROC and ECE (None where no site sent counts), and the
    largest gap per field.

    Args:
        classes: the classes audited.
        merged: counting target (:func:`subgroup_names`) -> pooled counts, or None.
        level: confidence level of the intervals.
    """
    out: dict[str, Any] = {}
    for c in classes:
        groups = {
            f"{f}={g}": _group_entry(merged.get(f"{c}{SEPARATOR}{f}={g}"), level)
            for f, gs in GROUPS.items()
            for g in gs
        }
        if any(e is not None for e in groups.values()):
            out[c] = {"groups": groups, "largest_gap": largest_gaps(groups, level)}
    return out
