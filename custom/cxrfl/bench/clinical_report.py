"""The report of ``cxrfl bench clinical`` (:mod:`cxrfl.bench.clinical`): the three targets per profile, their
per-class tables, what the maps and thresholds do on the external test sets, the learning curves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scipy.stats import binomtest

from cxrfl.bench.intervals import finite_mean
from cxrfl.bench.report_text import local_steps, provenance_line, verdict

AUROC_TOLERANCE = 0.002
"""Issue 45: federated pooled AUROC within this of the AUROC of the pooled scores, every class."""
ECE_LIMIT = 0.05
"""Issue 45: after calibration, ECE at most this where it was above, and never worse."""
LEVEL = 0.95
"""Confidence level of the sensitivity intervals."""


def targets(runs: Sequence[Mapping[str, Any]], target: float) -> list[dict[str, Any]]:
    """One profile's three targets over its seeds: ``target``, ``measured`` and ``met`` (None: nothing measured).

    Args:
        runs: the profile's runs.
        target: the sensitivity the operating points were chosen for.
    """
    diffs = [r["diff"] for run in runs for r in run["auroc"].values()]
    pairs = training_pairs(runs)
    above = [p for p in pairs if p["before"] > ECE_LIMIT]
    fixed = [p for p in above if p["after"] <= ECE_LIMIT]
    worse = [p for p in pairs if p["after"] > p["before"]]
    consortium = [p.get("after_consortium", p["after"]) for p in pairs]  # runs before site copies: one map
    c_fixed = sum(a <= ECE_LIMIT for p, a in zip(pairs, consortium, strict=True) if p["before"] > ECE_LIMIT)
    c_worse = sum(a > p["before"] for p, a in zip(pairs, consortium, strict=True))
    rates = [r for run in runs for r in run["sensitivity"].values()]
    hits = sum(r["low"] <= target <= r["high"] for r in rates)
    not_below = sum(r["high"] >= target for r in rates)
    misses = len(rates) - hits
    chance = binomtest(misses, len(rates), 1 - LEVEL, alternative="greater").pvalue if rates else None
    return [
        {
            "target": f"federated pooled AUROC within {AUROC_TOLERANCE:g} of the central AUROC of the pooled scores, "
            "every class",
            "measured": f"largest absolute difference {max(diffs):.4f} over {len(diffs)} (class, seed)"
            if diffs
            else "-",
            "met": max(diffs) <= AUROC_TOLERANCE if diffs else None,
        },
        {
            "target": f"per site and class, ECE after calibration <= {ECE_LIMIT:g} where above, never worse",
            "measured": f"{len(above)} of {len(pairs)} (site, class, seed) above {ECE_LIMIT:g} before, {len(fixed)} "
            f"brought to <= {ECE_LIMIT:g}; {len(worse)} made worse (with the consortium's map alone: {c_fixed} "
            f"brought to <= {ECE_LIMIT:g}, {c_worse} made worse)"
            if pairs
            else "-",
            "met": len(fixed) == len(above) and not worse if pairs else None,
        },
        {
            "target": f"test sensitivity of the operating point chosen for {target:g} on validation: {target:g} within "
            f"its {LEVEL:.0%} Wilson interval, every class",
            "measured": f"{hits} of {len(rates)} (class, seed) hold {target:g}; {misses} misses, P(>= {misses} by "
            f"chance at {1 - LEVEL:.0%} each) = {chance:.3g}; not significantly below {target:g} (interval reaching "
            f"it): {not_below} of {len(rates)}"
            if rates
            else "-",
            "met": misses == 0 if rates else None,
        },
    ]


def training_pairs(runs: Sequence[Mapping[str, Any]], *, external: bool = False) -> list[dict[str, Any]]:
    """The ECE pairs of the training sites, whose validation splits fitted the maps (``external``: the other sites').

    Args:
        runs: a profile's runs.
        external: the pairs of the sites that only test instead.
    """
    return [p for run in runs for p in run["ece"] if (p["site"] in run.get("training_sites", [p["site"]])) != external]


def external_lines(runs: Sequence[Mapping[str, Any]], target: float) -> list[str]:
    """What the maps and thresholds do on test sets that never fitted them (reported, not a target)."""
    pairs = training_pairs(runs, external=True)
    runs = [run for run in runs if "sensitivity_external" in run]  # runs of before the split: none
    rates = [r for run in runs for r in run["sensitivity_external"].values()]
    if not pairs and not rates:
        return []
    above = [p for p in pairs if p["before"] > ECE_LIMIT]
    fixed = sum(p["after"] <= ECE_LIMIT for p in above)
    worse = sum(p["after"] > p["before"] for p in pairs)
    hits = sum(r["low"] <= target <= r["high"] for r in rates)
    per_class: dict[str, list[str]] = {}
    for run in runs:
        for c, r in run["sensitivity_external"].items():
            per_class.setdefault(c, []).append(f"{r['value']:.3f}")
    values = "; ".join(f"{c} {' / '.join(v)}" for c, v in sorted(per_class.items()))
    return [
        "",
        "On the external test set(s), which fitted nothing (reported, not a target: another population): "
        f"ECE above {ECE_LIMIT:g} before in {len(above)} of {len(pairs)} (class, seed), brought to <= {ECE_LIMIT:g} "
        f"in {fixed}, made worse in {worse}; test sensitivity holds {target:g} in {hits} of {len(rates)} "
        f"(class, seed), per class one value per seed: {values}.",
    ]


def format_report(results: Mapping[str, Any]) -> str:
    """The Markdown report: per profile the three targets, then their per-class tables; the curves, provenance.

    Args:
        results: what :func:`run_clinical` writes.
    """
    s = results["settings"]
    lines = [
        "# Evaluation-only federation: pooled AUROC, calibration, operating points (issue 45)",
        "",
        f"{s['seeds']} seed(s) per profile; one model per seed trained by surgical aggregation, {s['image_size']} px "
        f"from scratch with the demo job's training settings, {local_steps(s['steps'])}, rounds until the mean "
        f"validation loss has not improved for {s['patience']} (at most {s['rounds']}). Evaluated by the "
        f"evaluation-only server (sites in float32, minimum cell {s['min_cell']}, {s['bins']} logit bins): "
        f"on the test splits{' (and the external test sets, as sites that only test)' if s['external'] else ''}; "
        f"on the training sites' validation splits with {s['calibration']} calibration and an operating point "
        f"for sensitivity {s['target_sensitivity']:g}. Central: `cxrfl predict`'s code path "
        "(float32) on the same test images. A consortium map is kept where a likelihood-ratio test (level 0.05) "
        "says it fits the pooled validation counts better than the raw scores; each site's copy takes, per "
        "class, the raw scores, the consortium's map or its own, by the least AIC on its own validation counts; "
        "a threshold reaches the target on new images (k of n validation positives count as k / (n + 1)).",
    ]
    for profile in s["profiles"]:
        runs = [r for r in results["runs"].values() if r["profile"] == profile]
        lines += ["", f"## {profile}", "", "| target | measured | verdict |", "| --- | --- | --- |"]
        lines += [
            f"| {t['target']} | {t['measured']} | {verdict(t['met'])} |" for t in targets(runs, s["target_sensitivity"])
        ]
        lines += external_lines(runs, s["target_sensitivity"])
        lines += _auroc_table(runs) + _ece_table(runs) + _sensitivity_table(runs, s["target_sensitivity"])
        lines += [""] + [f"- {n}" for n in results.get("profiles", {}).get(profile, {}).get("notes", [])]
    lines += ["", "![learning curves](learning_curves.png)", "", provenance_line(results)]
    return "\n".join(lines) + "\n"


def _auroc_table(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Target 1 per class: federated and central AUROC (mean over seeds), the largest difference."""
    lines = [
        "",
        "### Pooled AUROC, federated vs central",
        "",
        "Same images both sides: the test splits of the sites that sent counts for the class (sites withheld below the "
        "minimum cell are left out of both).",
        "",
        "| class | sites pooled | positives / negatives | federated AUROC | central AUROC | max abs difference "
        "| seeds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted({c for run in runs for c in run["auroc"]}):
        rows = [run["auroc"][c] for run in runs if c in run["auroc"]]
        first = rows[0]
        lines.append(
            f"| {c} | {first['sites']} (withheld {first['withheld']}) | {first['positives']} / {first['negatives']} | "
            f"{_mean(r['federated'] for r in rows)} | {_mean(r['central'] for r in rows)} | "
            f"{max(r['diff'] for r in rows):.5f} | {len(rows)} |"
        )
    return lines


def _ece_table(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Target 2 per class: its (site, seed) pairs, mean ECE before and after, how many above, fixed, worse."""
    pairs = training_pairs(runs)
    lines = [
        "",
        "### Calibration: ECE per training site's test split",
        "",
        "Per (training site, seed) with at least the minimum cell of positives and negatives; the product's ECE (15 "
        "equal-width bins over the counts) of the raw scores and after the map the site uses: its copy of the fit "
        "(its own map where its validation counts reject the consortium's, else the consortium's; no map: the raw "
        "scores, as `cxrfl predict` shows them). 'consortium': after the consortium's map alone.",
        "",
        f"| class | pairs | without a map | own maps | mean ECE before | mean ECE after | after, consortium's map | "
        f"above {ECE_LIMIT:g} before | fixed | made worse |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted({p["class"] for p in pairs}):
        mine = [p for p in pairs if p["class"] == c]
        above = [p for p in mine if p["before"] > ECE_LIMIT]
        cells = [
            c,
            len(mine),
            sum(not p["mapped"] for p in mine),
            sum(p.get("own_map", False) for p in mine),
            _mean(p["before"] for p in mine),
            _mean(p["after"] for p in mine),
            _mean(p.get("after_consortium", p["after"]) for p in mine),
            len(above),
            sum(p["after"] <= ECE_LIMIT for p in above),
            sum(p["after"] > p["before"] for p in mine),
        ]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return lines


def _sensitivity_table(runs: Sequence[Mapping[str, Any]], target: float) -> list[str]:
    """Target 3 per class: each seed's test sensitivity with its Wilson interval, and how many hold the target."""
    lines = [
        "",
        f"### Operating point for sensitivity {target:g}",
        "",
        "Threshold chosen on the pooled validation counts for the expected sensitivity on new images (k of n "
        "validation positives above it count as k / (n + 1)); test sensitivity pooled over the training sites "
        f"labelling the class, one entry per seed: value [{LEVEL:.0%} Wilson interval] (positives found / "
        f"positives). At {LEVEL:.0%}, about {1 - LEVEL:.0%} of the intervals miss the target by chance alone, and "
        "more where the validation split is small: the threshold's own sampling error is not in the test interval.",
        "",
        "| class | validation sensitivity (per seed) | test sensitivity (per seed) | seeds holding the target |",
        "| --- | --- | --- | --- |",
    ]
    for c in sorted({c for run in runs for c in run["sensitivity"]}):
        rows = [run["sensitivity"][c] for run in runs if c in run["sensitivity"]]
        tests = "; ".join(f"{r['value']:.3f} [{r['low']:.3f}, {r['high']:.3f}] ({r['k']}/{r['n']})" for r in rows)
        hits = sum(r["low"] <= target <= r["high"] for r in rows)
        val = ", ".join(f"{r['val_sensitivity']:.3f}" for r in rows)
        lines.append(f"| {c} | {val} | {tests} | {hits} of {len(rows)} |")
    return lines


def _mean(values: Any) -> str:
    m = finite_mean(values)
    return "n/a" if m is None else f"{m:.4f}"


def plot_curves(results: Mapping[str, Any], path: Path) -> None:
    """Every run's learning curve (the sites' mean validation loss and AUROC per round), one colour per profile.

    Args:
        results: what :func:`run_clinical` writes.
        path: PNG file.
    """
    from cxrfl.bench.plots import curves_by

    s = results["settings"]
    curves_by(list(results["runs"].values()), "profile", s["profiles"], "clinical benchmark", s["seeds"], path)
