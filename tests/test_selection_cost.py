"""The validation AUROC a selection rule gave up, from a run's stored curve (issue 41, point 4)."""

from __future__ import annotations

import pytest
from cxrfl.bench.reselection import DELTA_HEADER, delta_rows
from cxrfl.bench.selection_cost import COST_LIMIT, costly_entries, marked, mean_cost, run_cost


def run(val_auroc: list[float | None], best_round: int, first: int = 0) -> dict:
    rounds = list(range(first, first + len(val_auroc)))
    return {"curve_rounds": rounds, "val_auroc": val_auroc, "best_round": best_round}


def test_the_cost_is_the_best_rounds_validation_auroc_minus_the_selected_rounds():
    assert run_cost(run([0.5, 0.63, 0.73, 0.71], 0)) == pytest.approx(0.23)
    assert run_cost(run([0.5, 0.63, 0.73, 0.71], 2)) == 0.0
    # rounds are named, not indexed: a curve that starts at round 3 selects by round number
    assert run_cost(run([0.6, 0.9, 0.7], 5, first=3)) == pytest.approx(0.2)
    # an undefined AUROC (a round without both label values) is skipped in the maximum
    assert run_cost(run([None, 0.6, 0.7], 1)) == pytest.approx(0.1)
    assert run_cost(run([0.6, 0.7], 9)) is None and run_cost(run([None, 0.7], 0)) is None
    assert run_cost({"best_round": 0}) is None


def test_a_method_is_costly_when_its_mean_over_seeds_is_above_the_limit():
    runs = [run([0.5, 0.6, 0.62], 0), run([0.5, 0.55], 1)]  # 0.12 and 0.0: mean 0.06
    assert mean_cost(runs) == pytest.approx(0.06) and mean_cost([]) is None
    assert COST_LIMIT == 0.05  # the issues' smallest meaningful AUROC difference
    results = {
        "methods": {
            "vanilla": {"runs": runs},
            "sa": {"runs": [run([0.6, 0.64], 0)]},  # 0.04: within the limit
            "nocurve": {"runs": [{"best_round": 0}]},
        }
    }
    assert marked("FL", 0.06) == "FL (NOT A RESULT: selection gave up 0.060)" and marked("SA", 0.04) == "SA"
    assert marked("SA", None) == "SA"
    assert costly_entries(results, ["vanilla", "sa", "nocurve", "absent"]) == {"vanilla": pytest.approx(0.06)}


def test_the_selection_rule_table_shows_what_each_rule_gave_up():
    deltas = {
        "vanilla-fedavg": {
            "label": "FL (FedAvg)",
            "before_rule": "head",
            "best_round": {"before": 10.4, "after": 0.6},
            "cost": {"before": 0.0162, "after": 0.2261},
            "mean_auroc": {"hospital-a": {"before": 0.69, "after": 0.52, "change": -0.17}},
        }
    }
    (row,) = delta_rows(deltas)
    assert dict(zip(DELTA_HEADER, row)) == {
        "method": "FL (FedAvg) (before: `head`)",
        "test set": "hospital-a",
        "mean AUROC before": "0.6900",
        "after": "0.5200",
        "change": "-0.1700",
        "selected round before → after": "10.4 → 0.6",
        "val AUROC given up before → after": "0.0162 → 0.2261",
    }
