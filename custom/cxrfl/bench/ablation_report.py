"""``ablation.md`` of an ablation: mean AUROC per setting and surgical aggregation against each
method, paired over the settings and over every (setting, seed)."""

from __future__ import annotations

from typing import Any

from cxrfl.bench.intervals import finite_mean
from cxrfl.bench.report import effect_row, stars
from cxrfl.bench.report_text import markdown_table, num_text
from cxrfl.bench.reselection import DELTA_HEADER, delta_rows
from cxrfl.bench.selection_cost import COST_LIMIT, marked


def _mean_cell(r: dict[str, Any]) -> str:
    """One setting's cell: the mean ± SD over seeds, marked by the paired test against the reference.

    Args:
        r: one method's ``by_value`` entry for the setting.
    """
    over = r["over_seeds"]
    text = f"{num_text(over['mean'])}" + (f" ± {over['sd']:.3f}" if over.get("sd") is not None else "")
    vs = (r.get("vs_reference") or {}).get("seeds") or {}
    return f"{text} {stars(vs.get('p'))}".strip()


def format_ablation(summary: dict[str, Any]) -> str:
    """The Markdown tables of an ablation: mean AUROC on the held-out test set per setting, and
    surgical aggregation against each method paired over the settings (the papers' test) and over
    every (setting, seed).

    Args:
        summary: what :func:`cxrfl.bench.compare.run_ablation` writes to ``ablation.json``.
    """
    values = summary["values"]
    what = (
        "number of sites (4 shared classes)" if summary["ablation"] == "sites" else "number of shared classes (4 sites)"
    )
    rows = [[d["label"]] + [_mean_cell(d["by_value"][v]) for v in values] for d in summary["methods"].values()]
    ref = summary["methods"].get(summary["reference"], {}).get("label", summary["reference"])
    tests = [
        effect_row(
            marked(d["label"], _mean_cost(d, values)),
            d["vs_reference"].get("settings"),
            d["vs_reference"].get("setting_seeds"),
        )
        for d in summary["methods"].values()
        if d.get("vs_reference")
    ]
    header = [
        "method",
        "Δ settings",
        "95% CI",
        "d_z",
        "t-test p",
        "Wilcoxon p",
        "settings",
        "Δ (setting, seed)",
        "95% CI",
        "d_z",
        "t-test p",
        "pairs",
    ]
    seeds = max((len(d["by_value"][v]["mean_by_seed"]) for d in summary["methods"].values() for v in values), default=0)
    return "\n".join(
        [
            f"# Ablation: {what} ({summary['profile']})",
            "",
            f"Mean AUROC on the held-out fully annotated test set, mean ± SD over {seeds} seed(s); marks: paired "
            "t-test over "
            f"the seeds against {ref}.",
            "",
            markdown_table(["method"] + [str(v) for v in values], rows),
            "",
            f"## {ref} against each method",
            "",
            f"Δ = {ref} - method. Paired over the settings (each setting's mean over seeds; the papers' test) and over "
            f"every (setting, seed). With {len(values)} settings the smallest two-sided Wilcoxon p is "
            f"{2 / 2 ** len(values):.3g}.",
            "",
            markdown_table(header, tests) if tests else "(no other method)",
            "",
            *_selection_costs(summary),
            *_selection_deltas(summary),
        ]
    )


def _mean_cost(d: dict[str, Any], values: list[Any]) -> float | None:
    """A method's selection cost averaged over the settings."""
    return finite_mean([d["by_value"][v].get("selection_cost") for v in values])


def _selection_costs(summary: dict[str, Any]) -> list[str]:
    """The validation AUROC each method's selection gave up per setting (none: no run has a curve)."""
    values = summary["values"]
    methods = summary["methods"].values()
    if all(_mean_cost(d, values) is None for d in methods):
        return []
    rows = [[d["label"], *(num_text(d["by_value"][v].get("selection_cost")) for v in values)] for d in methods]
    return [
        "## Validation AUROC given up by the selection rule",
        "",
        "Per setting, mean over seeds of each run's best mean validation AUROC minus its selected round's. A method "
        f"above {COST_LIMIT:g} on average over the settings is marked in the table above: its differences do not "
        "measure the method.",
        "",
        markdown_table(["method", *(str(v) for v in values)], rows),
        "",
    ]


def _selection_deltas(summary: dict[str, Any]) -> list[str]:
    """Per setting, how far each affected model moved when the selection rule changed (none: no run set aside)."""
    rows = [
        [str(v), *row] for v in summary["values"] for row in delta_rows(summary.get("selection_deltas", {}).get(v, {}))
    ]
    if not rows:
        return []
    return [
        "## Selection rule",
        "",
        "Per setting, each run selected by the comparison's rule against the same seed's run set aside from the "
        "other rule (mean AUROC over the classes each model predicts on a test set, then over the seeds both ran). "
        "Only these methods' validation depends on the rule, so each of their gaps to surgical aggregation moved by "
        "the change shown.",
        "",
        markdown_table([summary["ablation"], *DELTA_HEADER], rows),
        "",
    ]
