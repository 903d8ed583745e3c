"""A profile's comparison targets judged together: Holm's adjustment over the family, then each rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cxrfl.bench.intervals import detectable_difference, holm
from cxrfl.bench.selection_cost import costly_entries
from cxrfl.bench.statistics import compare_cells

Rule = Callable[[float, "float | None"], bool]
"""(difference, Holm-adjusted p of the paired t-test) -> met."""
Comparison = tuple[dict[str, Any], Rule]
"""A target's numbers (:func:`compared`) and the rule that judges them."""


def view_cell(results: dict[str, Any], entry: str, view: str) -> dict[str, Any] | None:
    """An entry's statistics on a view in a results dict (None: the entry did not run or lacks the view)."""
    return results["methods"].get(entry, {}).get("test", {}).get(view)


def view_classes(results: dict[str, Any], view: str, part: str | None) -> list[str]:
    """A view's classes: all (``part`` None), or its ``shared`` / ``unique`` ones."""
    d = results["views"][view]
    shared = set(d.get("shared") or [])
    return [c for c in d["classes"] if part is None or (c in shared) == (part == "shared")]


def part_mean(cell: dict[str, Any], part: str | None) -> float | None:
    """A view cell's mean AUROC over all its classes, or over its ``shared`` / ``unique`` ones."""
    return (cell[part] if part else cell)["mean"]


def compared(
    results: dict[str, Any],
    t: dict[str, Any],
    classes: list[str] | None = None,
    value: Callable[[dict[str, Any]], float | None] | None = None,
) -> dict[str, Any] | None:
    """Fill ``t`` with the two entries' means over ``classes``, their paired comparison and the entries whose
    selection gave up too much validation AUROC for the comparison to be a result (None: not run).

    Args:
        results: the results dict.
        t: the target record (entries, view and ``part``).
        classes: the classes compared (default: the view's classes of ``t["part"]``).
        value: a view cell -> the mean compared (default: the cell's mean over ``t["part"]``).
    """
    classes = view_classes(results, t["view"], t["part"]) if classes is None else classes
    ca, cb = view_cell(results, t["method"], t["view"]), view_cell(results, t["against"], t["view"])
    if ca is None or cb is None or not classes:
        return None
    va, vb = (value(ca), value(cb)) if value else (part_mean(ca, t["part"]), part_mean(cb, t["part"]))
    stats = compare_cells(ca, cb, classes) or {"classes": None, "seeds": None}
    t.update(
        value=va,
        other=vb,
        difference=None if va is None or vb is None else va - vb,
        classes=stats["classes"],
        seeds=stats["seeds"],
        selection_cost=costly_entries(results, [t["method"], t["against"]]),
    )
    return t


def target_record(
    name: str, view: str, a: str, b: str | None, rule: str, part: str | None = None, *, binding: bool
) -> dict[str, Any]:
    """A target's record before its numbers and verdict are filled in.

    Args:
        name: the target's wording.
        view: the test set (view) it is judged on.
        a: the entry held to the target.
        b: the entry it is compared with (None: a target on ``a`` alone).
        rule: the rule, in words.
        part: ``shared`` or ``unique`` classes only (None: all of the view's).
        binding: an issue sets this target for this profile (else: shown for information).
    """
    return {
        "target": name,
        "view": view,
        "method": a,
        "against": b,
        "part": part,
        "rule": rule,
        "value": None,
        "other": None,
        "difference": None,
        "classes": None,
        "seeds": None,
        "met": None,
        "selection_cost": {},
        "binding": binding,
    }


def judge(comparisons: list[Comparison], alpha: float = 0.05, unit: str = "classes") -> list[dict[str, Any]]:
    """Adjust the comparisons' p-values (the paired t-test over ``unit``) by Holm over the family, add
    each one's detectable difference, and set the verdicts on the adjusted p. A comparison with a
    ``selection_cost`` is not a result: its verdict stays None and the rule's is kept as ``rule_met``.

    Args:
        comparisons: the profile's comparison targets with their rules.
        alpha: the family-wise level.
        unit: ``classes`` (per-class AUROC averaged over seeds) or ``seeds`` (each seed's mean AUROC).
    """
    family = {i: (t[unit] or {}).get("p") for i, (t, _) in enumerate(comparisons)}
    adjusted = holm(family)
    size = sum(p is not None for p in family.values())
    for i, (t, ok) in enumerate(comparisons):
        c = t[unit]
        if c is not None:
            c["p_holm"] = adjusted[i]
            c["detectable"] = detectable_difference(c.get("n") or 0, c.get("sd"), alpha=alpha / max(size, 1))
        rule_met = None if t["difference"] is None else bool(ok(t["difference"], adjusted[i]))
        t["rule_met"] = rule_met
        t["met"] = None if t.get("selection_cost") else rule_met
    return [t for t, _ in comparisons]
