"""``report.md`` of a comparison: convergence, tables shaped like the papers' Tables 1-4, effect
sizes and tests against surgical aggregation, per-class detail, the targets, and the plots.

Cells of the papers' tables read ``mean +- SD`` over classes (AUROC averaged over seeds per class
first) with the paired t-test over classes against surgical aggregation as the papers mark it
(ns: p > 0.05, *: p <= 0.05, **: p <= 0.01, ***: p <= 0.001; ``=``: per-class AUROCs equal to the
reference's, no test possible); ``-`` where the mean is not defined (the model does not predict
every class of the column). Differences are surgical aggregation minus the other method.
"""

from __future__ import annotations

from typing import Any

from cxrfl.bench.arch import arch_label
from cxrfl.bench.protocol import code_label
from cxrfl.bench.report_text import ci_text as _ci
from cxrfl.bench.report_text import markdown_table, num_text
from cxrfl.bench.report_text import p_text as _p
from cxrfl.bench.reselection import format_deltas
from cxrfl.bench.selection_cost import COST_LIMIT, marked, mean_cost, over_limit
from cxrfl.bench.target_text import targets_section


def stars(p: float | None) -> str:
    """The papers' significance marks.

    Args:
        p: a p-value (None: no test).
    """
    if p is None:
        return ""
    return "***" if p <= 0.001 else "**" if p <= 0.01 else "*" if p <= 0.05 else "ns"


def _cell(summary: dict[str, Any] | None, test: dict[str, Any] | None = None, *, with_p: bool = True) -> str:
    """``mean ± SD mark``; ``test`` is a comparison over classes (its p marks the cell)."""
    if not summary or summary.get("mean") is None:
        return "-"
    text = num_text(summary["mean"])
    if summary.get("sd") is not None:
        text += f" ± {summary['sd']:.3f}"
    mark = ""
    if with_p and test is not None:
        mark = stars(test["p"]) if test.get("p") is not None else "=" if test.get("n", 0) >= 2 else ""
    return f"{text} {mark}".strip()


def _vs(cell: dict[str, Any], part: str = "all", over: str = "classes") -> dict[str, Any] | None:
    """A cell's comparison with the reference (``part``: all, shared, unique; ``over``: classes, seeds)."""
    comparison = (cell.get("vs_reference") or {}).get(part)
    return comparison[over] if comparison else None


def _views(results: dict[str, Any], kind: str) -> list[str]:
    return [v for v, d in results["views"].items() if d["kind"] == kind]


def _header(results: dict[str, Any]) -> list[str]:
    s = results["settings"]
    out = [f"# Method comparison: `{results['profile']}`", ""]
    if results.get("command"):
        out += [f"Command: `{results['command']}`", ""]
    steps = (
        f"capped at {s['steps']} steps per site (a smoke run, not the protocol)"
        if s.get("steps")
        else "over whole training splits"
    )
    out += [
        f"Protocol: {len(results['seeds'])} seed(s) (model init, data order; data and splits fixed); {arch_label(s)} "
        f"{'from ' + s['pretrained'] if s.get('pretrained') else 'from scratch'} at "
        f"{s['image_size']}x{s['image_size']} px, "
        f"batch {s['batch_size']}, Adam lr {s['lr']:g}; head warm-up {s['warmup_epochs']} epoch(s) at lr "
        f"{s['warmup_lr']:g} "
        f"(feature extractor frozen, shared by the methods of a seed); then rounds of one local epoch {steps} "
        "until the "
        f"mean validation BCE of the sites has not improved by {s['min_delta']:g} for {s['patience']} rounds (at most "
        f"{s['max_rounds']} rounds, a guard); the model of the lowest mean validation loss is selected "
        + (
            "(each site's loss over the classes it labels)"
            if s.get("selection") == "annotated"
            else "(each site's loss over the whole head: vanilla FL and centralized count other sites' classes "
            "as negatives, the rule before issue 41)"
        )
        + ". The one-site "
        f"baselines run the same loop: epochs until their validation loss stops improving. {s['n_boot']} bootstrap "
        "resamples per seed.",
        "",
    ]
    for m in results["machines"]:
        gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
        cap = (
            f" (torch CPU capability {m['cpu_capability']}, native bf16 {'yes' if m.get('native_bf16') else 'no'})"
            if m.get("cpu_capability")
            else ""
        )
        out.append(
            f"Machine ({m['runs']} run(s)): {m['cpu']}{cap}, {m['cores']} core(s) ({m['usable_cores']} usable), "
            f"{m['torch_threads']} torch thread(s), device {m['device']}{gpu}; torch {m['torch']}, "
            f"Python {m['python']}."
        )
    for c in results["commits"]:
        out.append(f"Code ({c['runs']} run(s)): commit {code_label(c, 10)}.")
    out += ["", f"Training time, all runs: {results['run_seconds'] / 3600:.2f} h.", ""]
    return out


def _data(results: dict[str, Any]) -> list[str]:
    out = ["## Data", ""] + [f"- {note}" for note in results["data"]["notes"]]
    out += [
        "",
        markdown_table(
            ["test set", "images", "classes", "positives per class"],
            [
                [k, str(t["n"]), str(len(t["classes"])), ", ".join(f"{c} {n}" for c, n in t["positives"].items())]
                for k, t in results["data"]["test_sets"].items()
            ],
        ),
        "",
        f"Shared classes (2+ sites): {', '.join(results['data']['shared_classes']) or 'none'}.",
        "",
    ]
    return out


def _convergence(results: dict[str, Any]) -> list[str]:
    rows = []
    for d in results["methods"].values():
        runs = d["runs"]
        early = sum(bool(r["stopped_early"]) for r in runs)
        rows.append(
            [
                d["label"],
                ", ".join(str(r["rounds"]) for r in runs),
                ", ".join(str(r["best_round"]) for r in runs),
                f"{early} of {len(runs)}",
                ", ".join(f"{r['seconds'] / 60:.1f}" for r in runs),
                num_text(mean_cost(runs)),
            ]
        )
    return [
        "## Convergence",
        "",
        "Every run trains until its validation loss stops improving; a run that reached the max_rounds guard "
        "instead is not converged and is counted below. Learning curves: `learning_curves.png`. The last column "
        "is the validation AUROC the selection rule gave up (the best round's mean validation AUROC minus the "
        f"selected round's, mean over seeds); a comparison with a method above {COST_LIMIT:g} is not a result "
        "(see Targets).",
        "",
        markdown_table(
            [
                "method",
                "rounds (epochs) per seed",
                "selected round per seed",
                "stopped early",
                "minutes per seed",
                "val AUROC given up",
            ],
            rows,
        ),
        "",
    ]


def _papers_tables(results: dict[str, Any]) -> list[str]:
    methods = results["methods"]
    ref = results.get("reference")
    ref_label = methods[ref]["label"] if ref else "-"
    site_views, ext_views, by_site = (
        _views(results, "site"),
        _views(results, "external"),
        _views(results, "external-by-site"),
    )
    out = [
        "## Mean AUROC, all classes (papers' Tables 1 and 2)",
        "",
        f"Mean ± SD over classes; marks: paired t-test over the classes against {ref_label}.",
        "",
    ]
    cols = site_views + ext_views
    rows = [
        [d["label"]] + [_cell(d["test"][v], _vs(d["test"][v]), with_p=name != ref) for v in cols]
        for name, d in methods.items()
    ]
    out += [
        markdown_table(["method"] + [f"{v} ({'test split' if v in site_views else 'external'})" for v in cols], rows),
        "",
    ]
    if len(site_views) > 1:
        out += [
            "## Shared vs unique classes on each site's test split (papers' Table 3)",
            "",
            "Marks: paired t-test over the shared (unique) classes against the reference.",
            "",
        ]
        header = ["method"] + [f"{v} {part}" for v in site_views for part in ("shared", "unique")]
        rows = [
            [d["label"]]
            + [
                _cell(d["test"][v].get(part), _vs(d["test"][v], part), with_p=name != ref)
                for v in site_views
                for part in ("shared", "unique")
            ]
            for name, d in methods.items()
        ]
        out += [markdown_table(header, rows), ""]
    if by_site:
        out += ["## External set by each site's classes (papers' Table 4)", ""]
        rows = [
            [d["label"]] + [_cell(d["test"][v], _vs(d["test"][v]), with_p=name != ref) for v in by_site]
            for name, d in methods.items()
        ]
        out += [
            markdown_table(["method"] + [f"{v.split('@')[0]}, {v.split('@')[1]} classes" for v in by_site], rows),
            "",
        ]
    return out


def effect_row(label: str, by_class: dict[str, Any] | None, by_seed: dict[str, Any] | None) -> list[str]:
    """One row of an effect-size table (the columns of :data:`EFFECT_HEADER`).

    Args:
        label: the row's label.
        by_class: the paired comparison over classes (None: none).
        by_seed: the paired comparison over seeds (None: none).
    """
    c, s = by_class or {}, by_seed or {}
    return [
        label,
        num_text(c.get("difference")),
        _ci(c.get("ci")),
        num_text(c.get("d_z"), 2),
        _p(c.get("p")),
        _p(c.get("wilcoxon_p")),
        str(c.get("n", "-")),
        num_text(s.get("difference")),
        _ci(s.get("ci")),
        num_text(s.get("d_z"), 2),
        _p(s.get("p")),
        str(s.get("n", "-")),
    ]


EFFECT_HEADER = [
    "method",
    "Δ classes",
    "95% CI",
    "d_z",
    "t-test p",
    "Wilcoxon p",
    "classes",
    "Δ seeds",
    "95% CI",
    "d_z",
    "t-test p",
    "seeds",
]


def _effects(results: dict[str, Any]) -> list[str]:
    methods = results["methods"]
    ref = results.get("reference")
    if ref is None:
        return []
    out = [
        "## Against surgical aggregation: effect sizes and tests",
        "",
        f"Δ = {methods[ref]['label']} - method. Over classes: per-class AUROC averaged over seeds, paired t-test "
        "(the papers' test) and Wilcoxon signed-rank test, t-interval of the mean difference, Cohen's d_z (mean "
        "difference / SD of the differences). Over seeds: the mean AUROC of each seed, paired by seed. A method "
        f"whose selection gave up more than {COST_LIMIT:g} of validation AUROC (see Convergence) is marked: its "
        "differences do not measure the method.",
        "",
    ]
    cost = {name: mean_cost(d["runs"]) for name, d in methods.items()}
    if over_limit(cost[ref]):
        out += [f"{marked(methods[ref]['label'], cost[ref])}: so is every row below.", ""]
    site_views = _views(results, "site")
    for v in site_views + _views(results, "external") + _views(results, "external-by-site"):
        rows = [
            effect_row(marked(d["label"], cost[name]), _vs(d["test"][v]), _vs(d["test"][v], over="seeds"))
            for name, d in methods.items()
            if name != ref and _vs(d["test"][v]) is not None
        ]
        if rows:
            out += [f"### {v}", "", markdown_table(EFFECT_HEADER, rows), ""]
    for part in ("unique", "shared"):
        rows = [
            effect_row(
                marked(f"{d['label']} on {v}", cost[name]), _vs(d["test"][v], part), _vs(d["test"][v], part, "seeds")
            )
            for v in site_views
            for name, d in methods.items()
            if name != ref and _vs(d["test"][v], part) is not None
        ]
        if rows:
            out += [
                f"### {part.capitalize()} classes of each site's test split",
                "",
                markdown_table(EFFECT_HEADER, rows),
                "",
            ]
    return out


def _intervals(results: dict[str, Any]) -> list[str]:
    methods = results["methods"]
    out = [
        "## Mean AUROC: bootstrap interval and spread over seeds",
        "",
        "Bootstrap: percentile interval of the mean over classes (test images resampled, the same resamples for "
        "every method of a seed, replicates pooled over seeds). Seeds: SD and t-interval of the per-seed means.",
        "",
    ]
    for v in _views(results, "site") + _views(results, "external"):
        rows = []
        for d in methods.values():
            cell = d["test"][v]
            rows.append(
                [
                    d["label"],
                    num_text(cell["mean"]),
                    _ci(cell.get("mean_ci")),
                    num_text(cell.get("mean_seed_sd")),
                    _ci(cell.get("mean_seed_ci")),
                    ", ".join(num_text(x) for x in cell["mean_by_seed"]),
                ]
            )
        out += [
            f"### {v}",
            "",
            markdown_table(["method", "mean", "bootstrap 95% CI", "SD over seeds", "t 95% CI", "per seed"], rows),
            "",
        ]
    return out


def _per_class(results: dict[str, Any]) -> list[str]:
    methods = results["methods"]
    ref = results.get("reference")
    out = ["## Per-class AUROC (mean over seeds; bootstrap 95% CI for the reference)", ""]
    for v in _views(results, "site") + _views(results, "external"):
        rows = []
        for c in results["views"][v]["classes"]:
            row = [c]
            for name, d in methods.items():
                a = d["test"][v]
                val = a["auroc"].get(c)
                if val is None:
                    row.append("n/a" if c not in a["model_knows"] else "undef")
                else:
                    ci = a["ci"].get(c)
                    row.append(f"{val:.3f}" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci and name == ref else ""))
            rows.append(row)
        out += [
            f"### {v}",
            "",
            markdown_table(["class"] + [d["label"] for d in methods.values()], rows),
            "",
            "n/a: the model does not predict the class (not defined); undef: one label value only in the test set.",
            "",
        ]
    return out


def _runs(results: dict[str, Any]) -> list[str]:
    rows = []
    for d in results["methods"].values():
        for r in d["runs"]:
            commit = (r.get("code") or {}).get("commit") or "unknown"
            rows.append(
                [
                    d["label"],
                    str(r["seed"]),
                    str(r["rounds"]),
                    str(r["best_round"]),
                    "early stop" if r["stopped_early"] else "max_rounds",
                    f"{r['seconds'] / 60:.1f}",
                    f"{r['images_per_second']:.1f}",
                    commit[:10],
                    r.get("machine", {}).get("device", "-"),
                ]
            )
    return [
        "## Runs",
        "",
        markdown_table(
            ["method", "seed", "rounds", "selected", "ended by", "minutes", "images/s per site", "commit", "device"],
            rows,
        ),
        "",
    ]


def format_report(results: dict[str, Any], *, summary: bool = False, heading: str = "#") -> str:
    """The Markdown report of a comparison.

    Args:
        results: what :func:`cxrfl.bench.compare.run_compare` returns.
        summary: only the settings, data, convergence, the papers' tables, the effect sizes and the
            targets (for BENCHMARKS.md).
        heading: the Markdown heading prefix of the title (sections get one more ``#``).
    """
    out = _header(results) + _data(results) + _convergence(results) + _papers_tables(results) + _effects(results)
    if not summary:
        out += _intervals(results) + _per_class(results)
    out += targets_section(results)
    out += format_deltas(results.get("selection_deltas") or {}, results["settings"].get("selection", "head"))
    if results.get("plots") and not summary:
        out += ["## Plots", ""] + [f"![{p}]({p})" for p in results["plots"]] + [""]
    if not summary:
        out += _runs(results)
    return _shift(out, heading)


def _shift(lines: list[str], heading: str) -> str:
    extra = "#" * (len(heading) - 1)
    return "\n".join(extra + line if line.startswith("#") else line for line in lines)
