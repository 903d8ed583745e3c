"""The pooled evaluation of a run as a report a clinician reads: ``cxrfl report RUN --clinical OUT``.

Reads ``cxrfl/evaluation.json`` as the server writes it: an evaluation-only run's report
(:func:`cxrfl.clinical.pooling.pooled_report` at the top level, with ``split`` and, where fitted,
``fitted``) or a training run's (the same under ``pooled``: the selected model on the test split).
Writes ``OUT/report.md`` (per class: sites pooled, cases, AUROC, sensitivity and specificity at the
threshold, calibration error, the operating point; the classes left out, said in words; the settings)
and two PNG grids, ``roc.png`` and ``reliability.png``, one panel per pooled class. The report counts
sites but never names them: which site labels which class stays in the owner-only evaluation.json.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cxrfl.clinical.subgroups import GROUPS
from cxrfl.errors import DataError

EVALUATION = "evaluation.json"
REPORT, ROC_PNG, RELIABILITY_PNG, GAPS_PNG = "report.md", "roc.png", "reliability.png", "subgroup_gaps.png"
_ENTRY_KEYS = ("sites_labelling", "sites_pooled", "sites_withheld", "auroc")
_POOLED_KEYS = ("at_threshold", "ece", "reliability")
_SETTINGS = ("min_cell", "level", "threshold")


@dataclass(frozen=True)
class PooledRun:
    """A run's pooled per-class evaluation, as read from its evaluation.json.

    Args:
        path: the evaluation.json read.
        pooled: :func:`cxrfl.clinical.pooling.pooled_report`'s dict.
        split: the sites' split that was scored.
        origin: what was evaluated, in words.
        fitted: calibration maps and operating points (``fitted``), or None.
    """

    path: Path
    pooled: Mapping[str, Any]
    split: str
    origin: str
    fitted: Mapping[str, Any] | None

    @property
    def classes(self) -> dict[str, Mapping[str, Any]]:
        """The classes with a pooled result, in report order."""
        return {c: e for c, e in self.pooled["classes"].items() if e["auroc"] is not None}


def find_evaluation(path: str | Path) -> Path:
    """The evaluation.json of a run.

    Args:
        path: the file itself, a server app folder, a simulator workspace or a downloaded job result.

    Raises:
        DataError: none found, or several (the message lists them).
    """
    path = Path(path)
    if path.is_file():
        return path
    for candidate in (path / EVALUATION, path / "cxrfl" / EVALUATION):
        if candidate.is_file():
            return candidate
    found = sorted(path.glob(f"**/cxrfl/{EVALUATION}"))
    if len(found) == 1:
        return found[0]
    if found:
        raise DataError(f"{len(found)} evaluations under {path} ({', '.join(map(str, found[:3]))}); name one")
    raise DataError(f"no cxrfl evaluation (cxrfl/{EVALUATION}) under {path}; did the job finish?")


def load_pooled(path: str | Path) -> PooledRun:
    """Read and check a run's pooled evaluation.

    Args:
        path: see :func:`find_evaluation`.

    Raises:
        DataError: no file, not JSON, no pooled results, or a class entry without a key the report needs.
    """
    file = find_evaluation(path)
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read {file}: {exc}") from None
    if not isinstance(data, Mapping):
        raise DataError(f"{file} holds no pooled per-class results")
    if isinstance(data.get("classes"), Mapping):
        pooled, split = data, str(data.get("split", "?"))
        origin = f"a model scored at every site without training, on the sites' {split} split"
    elif isinstance(data.get("pooled"), Mapping) and isinstance(data["pooled"].get("classes"), Mapping):
        pooled, split = data["pooled"], "test"
        origin = f"the selected model of a training run (round {data.get('best_round', '?')}), on the sites' test split"
    else:
        raise DataError(
            f"{file} holds no pooled per-class results (a training run pools nothing with local heads or "
            "without its test evaluation); run an evaluation-only job (job_recipes/fedeval) on the model"
        )
    missing = [k for k in _SETTINGS if k not in pooled]
    for c, e in pooled["classes"].items():
        wanted = _ENTRY_KEYS + (_POOLED_KEYS if isinstance(e, Mapping) and e.get("auroc") else ())
        missing += [f"{c}: {k}" for k in wanted if not isinstance(e, Mapping) or k not in e]
    if missing:
        raise DataError(f"{file}: the pooled results lack {missing[:5]}; were they written by cxrfl?")
    return PooledRun(
        file, pooled, split, origin, data.get("fitted") if isinstance(data.get("fitted"), Mapping) else None
    )


def _ci(v: Mapping[str, Any]) -> str:
    return f"{v['value']:.3f} ({v['low']:.3f}-{v['high']:.3f})"


def _rate(r: Mapping[str, Any]) -> str:
    return f"{r['value']:.1%} ({r['low']:.1%}-{r['high']:.1%}), {r['k']}/{r['n']}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _operating_point(op: Mapping[str, Any] | None) -> str:
    if op is None:
        return "none"
    return (
        f"p ≥ {op['threshold']:.3f} (calibrated {op['calibrated_threshold']:.3f}): sensitivity "
        f"{op['sensitivity']:.1%}, specificity {op['specificity']:.1%}" + ("" if op["met"] else "; target not reached")
    )


def class_table(run: PooledRun) -> list[str]:
    """The per-class Markdown table of the pooled classes.

    Args:
        run: :func:`load_pooled`'s result.
    """
    p, fitted = run.pooled, run.fitted
    level, t = f"{p['level']:.0%}", f"p ≥ {p['threshold']:g}"
    header = [
        "Class",
        "Sites pooled of labelling",
        "Positives / negatives",
        f"AUROC ({level} CI)",
        f"Sensitivity at {t} ({level} CI)",
        f"Specificity at {t} ({level} CI)",
        "ECE",
    ]
    if fitted:
        header += ["ECE after calibration", "Operating point"]
    rows = []
    for c, e in run.classes.items():
        a, at = e["auroc"], e["at_threshold"]
        row = [
            c,
            f"{len(e['sites_pooled'])} of {len(e['sites_labelling'])}",
            f"{a['n_pos']} / {a['n_neg']}",
            _ci(a),
            _rate(at["sensitivity"]),
            _rate(at["specificity"]),
            f"{e['ece']:.3f}",
        ]
        if fitted:
            after = e.get("ece_calibrated")
            row += [
                "not fitted" if after is None else f"{after:.3f}",
                _operating_point(fitted["operating_points"].get(c)),
            ]
        rows.append(row)
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(map(_cell, r)) + " |" for r in rows),
    ]


def left_out(run: PooledRun) -> list[str]:
    """One line per class not pooled, or pooled without some of the sites that label it.

    Args:
        run: :func:`load_pooled`'s result.
    """
    p = run.pooled
    rule = f"fewer than {p['min_cell']} positives or negatives: sent nothing"
    lines = []
    for c, e in p["classes"].items():
        labelling, pooled, withheld = (len(e[k]) for k in ("sites_labelling", "sites_pooled", "sites_withheld"))
        silent = labelling - pooled - withheld
        why = [f"{withheld} of {labelling} labelling site(s) had {rule}"] if withheld else []
        why += [f"{silent} of {labelling} labelling site(s) did not answer"] if silent else []
        if not labelling:
            lines.append(f"- **{c}**: labelled at no site; not evaluated.")
        elif e["auroc"] is None:
            one_label = "; the pooled cases hold one label only" if pooled else ""
            lines.append(f"- **{c}**: not pooled ({'; '.join(why) or 'no counts'}{one_label}).")
        elif why:
            lines.append(f"- **{c}**: pooled over {pooled} site(s) only ({'; '.join(why)}).")
    return lines or ["- none: every class labelled at a site was pooled over every site that labels it."]


def _fit_lines(run: PooledRun) -> list[str]:
    fitted = run.fitted
    if not fitted:
        return ["No calibration map or operating point was fitted in this run (fitting runs use `--split val`)."]
    maps = fitted.get("calibration") or {}
    kinds = sorted({m.get("kind", "?") for m in maps.values()})
    ops = list((fitted.get("operating_points") or {}).values())
    target = f"{ops[0]['target']}" + (f" ≥ {ops[0]['value']:g}" if ops and ops[0].get("value") is not None else "")
    lines = [
        f"Calibration maps ({', '.join(kinds) or 'none'}, {len(maps)} class(es)) and operating points "
        f"({'target ' + target if ops else 'none'}) were fitted on this run's {run.split} split, so the ECE after "
        f"calibration and the operating points' sensitivity and specificity are measured on the data they were "
        "fitted on: confirm them on the test split. An operating point applies to the raw probability.",
    ]
    failed = (fitted.get("fitted_on") or {}).get("calibration_not_fitted") or {}
    lines += [f"No calibration map could be fitted for {c}: {why}." for c, why in failed.items()]
    return lines


def subgroup_table(run: PooledRun) -> list[str]:
    """Per class and field (sex, age band, view): each group's pooled AUROC with its interval and
    ECE, and the largest gap between two groups with its interval."""
    audit = run.pooled.get("subgroups")
    if not audit:
        return [
            "No subgroup audit in this run (`subgroups: true` in the evaluation settings; the sites' data "
            "must have sex, age or view)."
        ]
    lines = [
        "| Class | Field | Groups: AUROC (interval), ECE | Largest gap (interval) |",
        "| --- | --- | --- | --- |",
    ]
    for c, entry in audit.items():
        for field, names in GROUPS.items():
            have = {g: e for g, e in entry["groups"].items() if g.startswith(f"{field}=") and e is not None}
            if not have:
                continue
            cells = "; ".join(
                f"{g.split('=', 1)[1]} {_ci(e['auroc'])}, n {e['auroc']['n_pos']}/{e['auroc']['n_neg']}, "
                f"ECE {e['ece']:.3f}"
                for g, e in sorted(have.items(), key=lambda ge: names.index(ge[0].split("=", 1)[1]))
            )
            gap = entry["largest_gap"].get(field)
            gap_text = (
                f"{gap['higher'].split('=', 1)[1]} - {gap['lower'].split('=', 1)[1]}: {gap['value']:+.3f} "
                f"({gap['low']:+.3f} to {gap['high']:+.3f})"
                if gap
                else "-"
            )
            lines.append(f"| {_cell(c)} | {field} | {cells} | {gap_text} |")
    return [
        *lines,
        "",
        "A group is pooled over the sites that label the class and sent counts for it (each with at least the "
        "minimum cell size of positives and of negatives in the group; n: positives/negatives). Age bands in "
        "years. The gap interval is that of the difference of two independent AUROCs (DeLong variances added): "
        "one that excludes 0 marks a group the model serves worse.",
    ]


def format_clinical_report(run: PooledRun, figures: Sequence[str]) -> str:
    """The Markdown report.

    Args:
        run: :func:`load_pooled`'s result.
        figures: the PNG file names written beside it (linked).
    """
    p, classes = run.pooled, run.classes
    bound = max((e["auroc"]["binning_bound"] for e in classes.values()), default=0.0)
    mean = f"{p['mean_auroc']:.3f}" if p.get("mean_auroc") is not None else "n/a"
    lines = [
        "# Clinical evaluation report",
        "",
        f"Evaluated: {run.origin}. Source: `{run.path}`.",
        "",
        f"Settings: minimum cell size {p['min_cell']} (a site sends nothing for a class where it has fewer "
        f"positives or negatives), threshold p ≥ {p['threshold']:g} (positive when the raw probability is at "
        f"or above it), {p['level']:.0%} intervals (AUROC: DeLong; sensitivity and specificity: Wilson).",
        "",
        f"## Per class ({len(classes)} pooled, mean AUROC {mean})",
        "",
        *class_table(run),
        "",
        "Each class is pooled over exactly the sites that label it, from binned score counts (no image or "
        f"per-image score left a site); each AUROC is within {bound:.4f} of the AUROC of the pooled raw "
        "scores. ECE: expected calibration error (15 equal-width probability bins), the mean gap between "
        "predicted probability and observed frequency (0: perfectly calibrated).",
        "",
        *_fit_lines(run),
        "",
        "## Classes left out or pooled without some sites",
        "",
        *left_out(run),
        "",
        "## Subgroups",
        "",
        *subgroup_table(run),
    ]
    names = {
        ROC_PNG: "ROC curves",
        RELIABILITY_PNG: "Reliability diagrams (before calibration)",
        GAPS_PNG: "Subgroup gaps",
    }
    for name in figures:
        lines += ["", f"## {names[name]}", "", f"![{names[name]}]({name})"]
    return "\n".join(lines) + "\n"


def _grid(n: int) -> tuple[Any, list[Any]]:
    """A figure with ``n`` square panels, four a row (matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 3.3 * rows), squeeze=False)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.set_axis_off()
    return fig, flat[:n]


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_roc(run: PooledRun, path: Path) -> Path:
    """One ROC panel per pooled class, with the threshold's point and the operating point where fitted.

    Args:
        run: :func:`load_pooled`'s result.
        path: the PNG.
    """
    fig, axes = _grid(len(run.classes))
    ops = (run.fitted or {}).get("operating_points") or {}
    for ax, (c, e) in zip(axes, run.classes.items()):
        at = e["at_threshold"]
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        if e.get("roc"):
            ax.plot(e["roc"]["fpr"], e["roc"]["tpr"], color="tab:blue")
        else:
            ax.text(0.5, 0.3, "no ROC stored\n(an older evaluation)", ha="center", fontsize=8)
        at_t = f"p ≥ {run.pooled['threshold']:g}"
        ax.plot(1 - at["specificity"]["value"], at["sensitivity"]["value"], "o", color="tab:orange", label=at_t)
        if c in ops:
            ax.plot(1 - ops[c]["specificity"], ops[c]["sensitivity"], "s", color="tab:red", label="operating point")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="1 - specificity", ylabel="sensitivity")
        ax.set_title(f"{c}\nAUROC {_ci(e['auroc'])}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def write_reliability(run: PooledRun, path: Path) -> Path:
    """One reliability diagram per pooled class (before calibration), each bin's dot sized by its cases.

    Args:
        run: :func:`load_pooled`'s result.
        path: the PNG.
    """
    fig, axes = _grid(len(run.classes))
    for ax, (c, e) in zip(axes, run.classes.items()):
        r = e["reliability"]
        dots = [(x, y, n) for x, y, n in zip(r["mean_predicted"], r["observed"], r["count"]) if n and x is not None]
        total = sum(n for *_, n in dots) or 1
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        ax.plot([x for x, *_ in dots], [y for _, y, _ in dots], color="tab:blue", lw=0.8)
        ax.scatter([x for x, *_ in dots], [y for _, y, _ in dots], s=[10 + 300 * n / total for *_, n in dots])
        after = e.get("ece_calibrated")
        title = f"{c}\nECE {e['ece']:.3f}" + ("" if after is None else f" ({after:.3f} after calibration)")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="mean predicted probability", ylabel="observed frequency")
        ax.set_title(title, fontsize=9)
    return _save(fig, path)


def _gaps(run: PooledRun) -> list[tuple[str, dict[str, Any]]]:
    audit = run.pooled.get("subgroups") or {}
    return [(f"{c}: {f}", g) for c, e in audit.items() for f, g in e["largest_gap"].items()]


def write_subgroup_gaps(run: PooledRun, path: Path) -> Path:
    """Per class and field, the largest AUROC gap between two groups with its interval (a forest plot).

    Args:
        run: :func:`load_pooled`'s result (with a subgroup audit).
        path: the PNG.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _gaps(run)
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.32 * len(rows)))
    for i, (_, g) in enumerate(rows):
        color = "tab:red" if g["low"] > 0 or g["high"] < 0 else "tab:blue"
        ax.errorbar(g["value"], i, xerr=[[g["value"] - g["low"]], [g["high"] - g["value"]]], fmt="o", color=color)
        ax.text(
            g["high"] + 0.005,
            i,
            f"{g['higher'].split('=', 1)[1]} - {g['lower'].split('=', 1)[1]}",
            va="center",
            fontsize=7,
        )
    ax.axvline(0, color="grey", lw=0.8, ls="--")
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("largest AUROC gap between two groups (red: the interval excludes 0)")
    return _save(fig, path)


def write_clinical_report(path: str | Path, out: str | Path) -> list[Path]:
    """``OUT/report.md`` and its figures (none when no class was pooled).

    Args:
        path: the run (see :func:`find_evaluation`).
        out: the folder (created).

    Raises:
        DataError: see :func:`load_pooled`.
    """
    run = load_pooled(path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = [write_roc(run, out / ROC_PNG), write_reliability(run, out / RELIABILITY_PNG)] if run.classes else []
    if _gaps(run):
        figures.append(write_subgroup_gaps(run, out / GAPS_PNG))
    report = out / REPORT
    report.write_text(format_clinical_report(run, [f.name for f in figures]))
    return [report, *figures]
