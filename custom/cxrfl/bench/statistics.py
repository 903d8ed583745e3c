"""From stored runs to the comparison's statistics, as the papers report them and a little more.

For every table row (:class:`cxrfl.bench.runs.Entry`) and view (a test set, or the external set
restricted to one site's classes):

- per-class AUROC per seed (``auroc_by_seed``), their mean over seeds per class (``auroc``), and
  ``mean +- SD`` over classes (the papers' cells), split into shared and unique classes on the
  sites' test splits; a class the model does not predict is "not defined", and so is every mean
  over a set that holds it;
- the mean AUROC per seed with its t-interval over seeds;
- 95 % percentile bootstrap intervals per class and of the mean (test images resampled, the same
  resamples for every method of a seed, replicates pooled over seeds);
- paired comparisons against surgical aggregation (:func:`cxrfl.bench.intervals.paired_comparison`):
  over classes (per-class AUROC averaged over seeds; paired t-test as the papers, Wilcoxon
  signed-rank test, mean difference with its interval, Cohen's d_z) and over seeds (the mean
  AUROC of each seed; the same tests), on all of a view's classes and on its shared and unique
  classes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cxrfl.bench.evaluate import TestSet
from cxrfl.bench.intervals import bootstrap_aurocs, mean_ci, paired_comparison, percentile_ci
from cxrfl.bench.profiles import BenchData
from cxrfl.bench.runs import GLOBAL
from cxrfl.bench.selection_cost import mean_cost
from cxrfl.nn.evaluation import shared_classes
from cxrfl.nn.metrics import summarise_auroc

Scores = Callable[[str, int], Mapping[str, np.ndarray] | None]
"""(entry, seed) -> the run's stored scores (None: not available)."""


@dataclass
class View:
    """A set of classes of one test set that the tables report.

    Args:
        name: ``<site>`` (its test split), ``<external>`` or ``<external>@<site>`` (the external
            set restricted to that site's classes).
        test: the test set name.
        classes: the classes.
        site: the training site whose own model (personalized FL, FedBN, individual) this view is about.
        kind: ``site``, ``external`` or ``external-by-site``.
        shared: for site views, the classes of this site that another site has too.
    """

    name: str
    test: str
    classes: list[str]
    site: str | None
    kind: str
    shared: list[str] | None = None


def make_views(data: BenchData, tests: Mapping[str, TestSet]) -> list[View]:
    """Each site's test split, each external set, and each external set by each site's classes.

    Args:
        data: the profile's data.
        tests: the test sets.
    """
    shared = shared_classes({s.site: list(s.classes) for s in data.sites})
    views = [
        View(s.site, s.site, tests[s.site].classes, s.site, "site", [c for c in s.classes if c in shared])
        for s in data.sites
    ]
    for name in data.external:
        t = tests[name]
        views.append(View(name, name, t.classes, None, "external"))
        if len(data.sites) > 1:
            views += [
                View(f"{name}@{s.site}", name, [c for c in t.classes if c in s.classes], s.site, "external-by-site")
                for s in data.sites
            ]
    return views


def model_key(models: Mapping[str, Any], view: View) -> str | None:
    """Which of a run's models a view scores: the global one, or the view's site's own (None: none)."""
    if GLOBAL in models:
        return GLOBAL
    return view.site if view.site in models else None


def view_aurocs(record: Mapping[str, Any], view: View) -> tuple[dict[str, float | None], list[str]]:
    """One run's per-class AUROC on a view (None: undefined or not predicted) and the view's
    classes its model predicts.

    Args:
        record: the run's record.
        view: the view.
    """
    key = model_key(record["models"], view)
    if key is None:
        return {c: None for c in view.classes}, []
    got = record["auroc"][view.test][key]
    known = set(record["models"][key])
    return {c: got.get(c) if c in known else None for c in view.classes}, [c for c in view.classes if c in known]


def part_mean(aurocs: Mapping[str, float | None], classes: Sequence[str], knows: Sequence[str]) -> float | None:
    """Mean AUROC over ``classes`` (None when the model lacks one of them or none is defined)."""
    return summarise_auroc({c: aurocs.get(c) for c in classes}, model_classes=knows)["mean"]


def compare_cells(
    a: Mapping[str, Any], b: Mapping[str, Any], classes: Sequence[str] | None = None
) -> dict[str, Any] | None:
    """A against B on one view (or on ``classes`` of it): over classes and over seeds.

    Args:
        a: a view cell (``auroc``, ``auroc_by_seed``, ``model_knows``).
        b: another method's cell of the same view (same seeds).
        classes: the classes compared (default: all of the view's).

    Returns:
        ``{'classes': ..., 'seeds': ...}`` (:func:`cxrfl.bench.intervals.paired_comparison`), or None
        when the mean of A or B over those classes is not defined.
    """
    keep = list(classes if classes is not None else a["auroc"])
    if (
        not keep
        or part_mean(a["auroc"], keep, a["model_knows"]) is None
        or part_mean(b["auroc"], keep, b["model_knows"]) is None
    ):
        return None
    by_class = paired_comparison({c: a["auroc"][c] for c in keep}, {c: b["auroc"][c] for c in keep})
    seeds_a = {i: part_mean(s, keep, a["model_knows"]) for i, s in enumerate(a["auroc_by_seed"])}
    seeds_b = {i: part_mean(s, keep, b["model_knows"]) for i, s in enumerate(b["auroc_by_seed"])}
    return {"classes": by_class, "seeds": paired_comparison(seeds_a, seeds_b)}


class Bootstrap:
    """Bootstrap replicates of the per-class AUROC of each stored run's model on each test set,
    computed once; resample indices depend on the seed only, so methods are resampled alike.

    Args:
        tests: the test sets.
        scores: loads a run's stored scores.
        n_boot: resamples per seed.
    """

    def __init__(self, tests: Mapping[str, TestSet], scores: Scores, n_boot: int) -> None:
        self.tests = tests
        self.scores = scores
        self.n_boot = n_boot
        self._cache: dict[tuple[str, int, str, str], np.ndarray | None] = {}

    def replicates(self, entry: str, seed: int, test: str, key: str) -> np.ndarray | None:
        """[n_boot, K_test] AUROC replicates (NaN for classes the model lacks); None without scores."""
        k = (entry, seed, test, key)
        if k not in self._cache:
            self._cache[k] = self._compute(entry, seed, test, key)
        return self._cache[k]

    def _compute(self, entry: str, seed: int, test: str, key: str) -> np.ndarray | None:
        scores = self.scores(entry, seed)
        if scores is None or f"{test}|{key}" not in scores:
            return None
        s = scores[f"{test}|{key}"]
        t = self.tests[test]
        out = np.full((self.n_boot, len(t.classes)), np.nan)
        known = ~np.isnan(s).all(axis=0)
        if known.any():
            out[:, known] = bootstrap_aurocs(t.labels[:, known], s[:, known], n_boot=self.n_boot, seed=10_000 + seed)
        return out


def _ci(replicates: np.ndarray) -> list[float] | None:
    interval = percentile_ci(replicates)
    return list(interval) if interval else None


def _intervals(
    pooled: np.ndarray, view: View, per_class: Mapping[str, float | None]
) -> tuple[dict[str, list[float] | None], list[float] | None]:
    """Per-class intervals and the interval of the mean over the defined classes, from pooled replicates."""
    ci = {c: _ci(pooled[:, j]) if per_class[c] is not None else None for j, c in enumerate(view.classes)}
    defined = [j for j, c in enumerate(view.classes) if per_class[c] is not None]
    if not defined:
        return ci, None
    with warnings.catch_warnings():  # a replicate where no class holds both labels: NaN, left out
        warnings.simplefilter("ignore", RuntimeWarning)
        row_means = np.nanmean(pooled[:, defined], axis=1)
    return ci, _ci(row_means)


def view_cell(entry: str, records: Sequence[Mapping[str, Any]], view: View, boot: Bootstrap) -> dict[str, Any]:
    """An entry's statistics on one view over its seeds (see the module docstring).

    Args:
        entry: the entry name.
        records: its runs, one per seed, in seed order.
        view: the view.
        boot: bootstrap replicates of the stored runs.
    """
    by_seed: list[dict[str, float | None]] = []
    knows: list[str] = []
    for r in records:
        aurocs, knows = view_aurocs(r, view)
        by_seed.append(aurocs)
    per_class = {
        c: None if any(a[c] is None for a in by_seed) else float(np.mean([a[c] for a in by_seed])) for c in view.classes
    }
    cell = summarise_auroc(per_class, shared=view.shared, model_classes=knows)
    seed_means = [part_mean(a, view.classes, knows) for a in by_seed]
    over_seeds = mean_ci(seed_means) if None not in seed_means else {"sd": None, "ci": None}
    reps = []
    for r in records:
        key = model_key(r["models"], view)
        rep = None if key is None else boot.replicates(entry, int(r["seed"]), view.test, key)
        if rep is not None:
            test_classes = boot.tests[view.test].classes
            reps.append(rep[:, [test_classes.index(c) for c in view.classes]])
    complete = bool(reps) and len(reps) == len(records) and bool(view.classes)
    ci, mean_boot = (
        _intervals(np.concatenate(reps), view, per_class) if complete else ({c: None for c in view.classes}, None)
    )
    cell.update(
        auroc=per_class,
        auroc_by_seed=by_seed,
        ci=ci,
        mean_ci=mean_boot if cell["mean"] is not None else None,
        mean_by_seed=seed_means,
        mean_seed_sd=over_seeds["sd"],
        mean_seed_ci=over_seeds["ci"],
        model_knows=knows,
    )
    return cell


def versus(cell: Mapping[str, Any], ref: Mapping[str, Any], view: View) -> dict[str, Any]:
    """The reference (surgical aggregation) against a method on one view: differences are
    reference - method, on all classes and on the shared and the unique ones.

    Args:
        cell: the method's cell.
        ref: the reference's cell.
        view: the view.
    """
    out = {"all": compare_cells(ref, cell)}
    if view.shared is not None:
        shared = set(view.shared)
        out["shared"] = compare_cells(ref, cell, [c for c in view.classes if c in shared])
        out["unique"] = compare_cells(ref, cell, [c for c in view.classes if c not in shared])
    return out


def ablation_summary(kind: str, runs: Mapping[str, Mapping[str, Any]], reference: str) -> dict[str, Any]:
    """Mean AUROC on the held-out fully annotated test set per ablation setting and method, and the
    papers' test: surgical aggregation against each method (differences reference - method), paired
    over settings (each setting's mean over seeds), and paired over every (setting, seed); and each
    setting's selection deltas (:func:`cxrfl.bench.reselection.selection_deltas`), where runs were set aside.

    Args:
        kind: ``sites`` or ``shared``.
        runs: setting -> the comparison's results (``results.json``).
        reference: the reference method.
    """
    values = list(runs)
    per: dict[str, dict[str, Any]] = {}
    for value, res in runs.items():
        view = next(v for v, d in res["views"].items() if d["kind"] == "external")
        for name, m in res["methods"].items():
            cell = m["test"][view]
            per.setdefault(name, {"label": m["label"], "by_value": {}})["by_value"][value] = {
                "mean": cell["mean"],
                "mean_by_seed": cell["mean_by_seed"],
                "over_seeds": mean_ci(cell["mean_by_seed"]),
                "vs_reference": (cell.get("vs_reference") or {}).get("all"),
                "selection_cost": mean_cost(m.get("runs") or []),
            }
    for name, d in per.items():
        if name == reference or reference not in per:
            d["vs_reference"] = None
            continue
        ref = per[reference]["by_value"]
        mine = d["by_value"]
        pairs_a = {f"{v}/{i}": x for v in values for i, x in enumerate(mine[v]["mean_by_seed"])}
        pairs_b = {f"{v}/{i}": x for v in values for i, x in enumerate(ref[v]["mean_by_seed"])}
        d["vs_reference"] = {
            "settings": paired_comparison(
                {v: ref[v]["over_seeds"]["mean"] for v in values}, {v: mine[v]["over_seeds"]["mean"] for v in values}
            ),
            "setting_seeds": paired_comparison(pairs_b, pairs_a),
        }
    deltas = {v: res["selection_deltas"] for v, res in runs.items() if res.get("selection_deltas")}
    return {"ablation": kind, "values": values, "reference": reference, "methods": per, "selection_deltas": deltas}
