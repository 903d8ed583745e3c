"""How much validation AUROC a run's selection rule gave up, and which comparisons rest on it.

Every method of a comparison is selected by the same rule: the round of the lowest mean validation
BCE (issue 41 point 4: each site's BCE over the classes it labels). BCE also measures calibration,
and vanilla FL's union head is miscalibrated on each site's own classes by design: every other
site's images train them as negatives, so their probabilities fall below the site's prevalence and
the site's BCE can rise while the model's ranking still learns. The rule then keeps an early round
that ranks barely above chance. The validation AUROC of every round is stored with each run, so the
cost is measured the same way for every method: the best mean validation AUROC over the run's
rounds minus that of the selected round (rank-based, so calibration does not move it).

A comparison between models is a result only when the rule did not give up more validation AUROC
than the smallest difference the targets call meaningful (:data:`COST_LIMIT`, the issues' 0.05):
otherwise the difference does not measure the methods, and the verdict says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

from cxrfl.bench.intervals import finite_mean

COST_LIMIT = 0.05
"""Mean validation AUROC over seeds a method's selection may give up before its comparisons are not results."""


def over_limit(cost: float | None) -> TypeGuard[float]:
    """Whether a method's mean selection cost is above :data:`COST_LIMIT` (unknown: not).

    Args:
        cost: the method's :func:`mean_cost`.
    """
    return cost is not None and cost > COST_LIMIT


def run_cost(run: dict[str, Any]) -> float | None:
    """A run's best mean validation AUROC over its rounds minus that at its selected round (None: no curve).

    Args:
        run: a stored run (``curve_rounds``, ``val_auroc``, ``best_round``).
    """
    rounds, auroc = run.get("curve_rounds") or [], run.get("val_auroc") or []
    if run.get("best_round") not in rounds:
        return None
    at = auroc[rounds.index(run["best_round"])]
    finite = [a for a in auroc if a is not None]
    return None if at is None or not finite else float(max(finite) - at)


def mean_cost(runs: Sequence[dict[str, Any]]) -> float | None:
    """The mean of :func:`run_cost` over a method's runs (None: none has a curve).

    Args:
        runs: the method's runs, one per seed.
    """
    return finite_mean([run_cost(r) for r in runs])


def costly_entries(results: dict[str, Any], entries: Sequence[str]) -> dict[str, float]:
    """Of ``entries``, those whose mean selection cost is above :data:`COST_LIMIT`, with that cost.

    Args:
        results: a comparison's results (each method's ``runs``).
        entries: the entries a comparison involves.
    """
    out = {}
    for e in entries:
        cost = mean_cost(results["methods"].get(e, {}).get("runs") or [])
        if over_limit(cost):
            out[e] = cost
    return out


def marked(label: str, cost: float | None) -> str:
    """A table row's label, marked as not a result when its method's selection cost is above :data:`COST_LIMIT`.

    Args:
        label: the row's label.
        cost: the method's mean selection cost (None: unknown).
    """
    if not over_limit(cost):
        return label
    return f"{label} (NOT A RESULT: selection gave up {cost:.3f})"
