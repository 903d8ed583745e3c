"""How far each model moved when the selection rule changed (issue 41, point 4).

A comparison run under one selection rule sets the stored runs of the other rule aside
(:meth:`cxrfl.bench.runs.RunStore.set_aside_selection`) before training them again. This module
pairs the two runs of each affected method and seed and reports, per test set, the mean AUROC
(over the classes the model predicts there, then over the seeds both rules ran) under each rule
and the change, and the selected round under each rule. The other methods are not affected by the
rule (their validation counts their own classes either way), so a gap between an affected method
and any other moves by exactly that method's change.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from cxrfl.bench.intervals import finite_mean
from cxrfl.bench.report_text import markdown_table
from cxrfl.bench.runs import GLOBAL, Entry, RunStore, safe_name
from cxrfl.bench.selection_cost import mean_cost


def _aurocs(record: dict[str, Any], test: str) -> dict[str, Any]:
    """A run's per-class AUROC of its global model on ``test`` (None: undefined)."""
    return ((record.get("auroc") or {}).get(test) or {}).get(GLOBAL, {})


def _mean_auroc(record: dict[str, Any], test: str) -> float | None:
    values = [v for v in _aurocs(record, test).values() if v is not None]
    return float(np.mean(values)) if values else None


def _class_means(pairs: list[tuple[dict[str, Any], dict[str, Any]]], test: str) -> dict[str, dict[str, Any]]:
    """Per class of ``test``: its AUROC under each rule, averaged over the seeds both ran."""
    classes = sorted({c for old, new in pairs for c in (*_aurocs(old, test), *_aurocs(new, test))})
    return {
        c: {
            "before": finite_mean([_aurocs(old, test).get(c) for old, _ in pairs]),
            "after": finite_mean([_aurocs(new, test).get(c) for _, new in pairs]),
        }
        for c in classes
    }


def selection_deltas(store: RunStore, entries: Sequence[Entry], seeds: Sequence[int]) -> dict[str, Any]:
    """Per affected entry: the rule its set-aside runs were selected by, the seeds both rules ran,
    the mean selected round under each, and per test set the mean AUROC under each and the change
    (and under ``classes`` each class's AUROC under each rule).

    Args:
        store: the comparison's runs.
        entries: the table rows.
        seeds: the seeds reported.
    """
    out: dict[str, Any] = {}
    for e in entries:
        if not e.method.selection_matters:
            continue
        for folder in sorted(store.root.glob("superseded-selection-*")):
            rule = folder.name.removeprefix("superseded-selection-")
            pairs = [
                (json.loads(p.read_text()), store.load(e.name, s))
                for s in seeds
                if (p := folder / safe_name(e.name) / f"seed-{s}.json").is_file() and store.done(e.name, s)
            ]
            if not pairs:
                continue
            tests = sorted({t for old, new in pairs for t in (new.get("auroc") or {})})
            per_test = {}
            for t in tests:
                before = finite_mean([_mean_auroc(old, t) for old, _ in pairs])
                after = finite_mean([_mean_auroc(new, t) for _, new in pairs])
                change = None if before is None or after is None else after - before
                per_test[t] = {"before": before, "after": after, "change": change, "classes": _class_means(pairs, t)}
            out[e.name] = {
                "label": e.label,
                "before_rule": rule,
                "seeds": [s for s in seeds if (folder / safe_name(e.name) / f"seed-{s}.json").is_file()],
                "best_round": {
                    "before": finite_mean([old.get("best_round") for old, _ in pairs]),
                    "after": finite_mean([new.get("best_round") for _, new in pairs]),
                },
                "mean_auroc": per_test,
                "cost": {"before": mean_cost([old for old, _ in pairs]), "after": mean_cost([new for _, new in pairs])},
            }
    return out


DELTA_HEADER = [
    "method",
    "test set",
    "mean AUROC before",
    "after",
    "change",
    "selected round before → after",
    "val AUROC given up before → after",
]
"""The columns of :func:`delta_rows`."""


def delta_rows(deltas: dict[str, Any]) -> list[list[str]]:
    """One row per affected method and test set: mean AUROC under each rule, the change, the selected rounds and
    the validation AUROC each rule gave up (:func:`cxrfl.bench.selection_cost.mean_cost`).

    Args:
        deltas: :func:`selection_deltas`.
    """

    def f(v: float | None, sign: bool = False) -> str:
        return "-" if v is None else (f"{v:+.4f}" if sign else f"{v:.4f}")

    rows = []
    for d in deltas.values():
        br = d["best_round"]
        rounds = " → ".join("-" if v is None else f"{v:.1f}" for v in (br["before"], br["after"]))
        cost = d.get("cost") or {}
        given_up = " → ".join(f(cost.get(k)) for k in ("before", "after"))
        label = f"{d['label']} (before: `{d['before_rule']}`)"
        for t, v in d["mean_auroc"].items():
            rows.append([label, t, f(v["before"]), f(v["after"]), f(v["change"], sign=True), rounds, given_up])
    return rows


def format_deltas(deltas: dict[str, Any], rule: str) -> list[str]:
    """The report section (empty when no run was set aside).

    Args:
        deltas: :func:`selection_deltas`.
        rule: the comparison's selection rule.
    """
    if not deltas:
        return []
    return [
        "## Selection rule",
        "",
        f"Runs selected by the `{rule}` rule against the same seeds' runs set aside from the other rule (mean AUROC "
        "over the classes each model predicts on a test set, then over the seeds both ran). Only these methods' "
        "validation depends on the rule, so each of their gaps to any other method moved by the change shown.",
        "",
        markdown_table(DELTA_HEADER, delta_rows(deltas)),
        "",
    ]
