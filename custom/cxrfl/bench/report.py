"""``report.md`` of a comparison: tables shaped like the papers' Tables 1-4, per-class detail,
the targets, and the plots.

Cells read ``mean +- SD`` over classes (AUROC averaged over seeds per class first) with the
paired t-test against surgical aggregation as the papers mark it (ns: p > 0.05, *: p <= 0.05,
**: p <= 0.01, ***: p <= 0.001; ``=``: per-class AUROCs equal to the reference's, no test
possible); ``-`` where the mean is not defined (the model does not predict every class of the
column).
"""

from __future__ import annotations

from typing import Any


def stars(p: float | None) -> str:
    """The papers' significance marks.

    Args:
        p: a p-value (None: no test).
    """
    if p is None:
        return ""
    return "***" if p <= 0.001 else "**" if p <= 0.01 else "*" if p <= 0.05 else "ns"


def _num(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _cell(summary: dict[str, Any] | None, test: dict[str, Any] | None = None, *, with_p: bool = True) -> str:
    if not summary or summary.get("mean") is None:
        return "-"
    text = _num(summary["mean"])
    if summary.get("sd") is not None:
        text += f" ± {summary['sd']:.3f}"
    mark = ""
    if with_p and test is not None:
        # a t-test needs differences that vary: "=" marks per-class AUROCs equal to the reference's
        mark = stars(test["p"]) if test.get("p") is not None else "=" if test.get("n", 0) >= 2 else ""
    return f"{text} {mark}".strip()


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _p(cell: dict[str, Any]) -> dict[str, Any] | None:
    return cell.get("p_vs_reference")


def _views(results: dict[str, Any], kind: str) -> list[str]:
    return [v for v, d in results["views"].items() if d["kind"] == kind]


def format_report(results: dict[str, Any], *, summary: bool = False, heading: str = "#") -> str:
    """The Markdown report of a comparison.

    Args:
        results: what :func:`cxrfl.bench.compare.run_compare` returns.
        summary: only the settings, data, the papers' tables and the targets (for BENCHMARKS.md).
        heading: the Markdown heading prefix of the title (sections get one more ``#``).
    """
    s = results["settings"]
    methods = results["methods"]
    ref = results.get("reference")
    ref_label = methods[ref]["label"] if ref else "-"
    site_views, ext_views, by_site = _views(results, "site"), _views(results, "external"), _views(results, "external-by-site")
    out: list[str] = [f"# Method comparison: `{results['profile']}`", ""]
    if results.get("command"):
        out += [f"Command: `{results['command']}`", ""]
    m = results["machine"]
    out += [
        f"Machine: {m['cpus']} CPU core(s), {m['threads']} torch thread(s), {m['device']}; torch {m['torch']}, "
        f"Python {m['python']}. Wall time {results['wall_seconds'] / 60:.1f} min.",
        "",
        f"Settings: {len(results['seeds'])} seed(s) (model init, data order); DenseNet121 "
        f"{'from ' + s['pretrained'] if s.get('pretrained') else 'from scratch'} at "
        f"{s['image_size']}x{s['image_size']} px, batch {s['batch_size']}, Adam lr {s['lr']} (warm-up {s['warmup_lr']}, "
        f"{s['warmup_epochs']} epoch(s), feature extractor frozen), {s['rounds']} rounds of 1 local epoch capped at "
        f"{s['steps'] if s['steps'] else 'all'} steps per site (centralized: the sum over sites), model selected on the "
        f"mean of the sites' validation BCE (patience {s['patience']}); {s['n_boot']} bootstrap resamples per seed.",
        "",
        "## Data",
        "",
    ]
    out += [f"- {note}" for note in results["data"]["notes"]]
    out += ["", _table(
        ["test set", "images", "classes", "positives per class"],
        [[k, str(t["n"]), str(len(t["classes"])), ", ".join(f"{c} {n}" for c, n in t["positives"].items())]
         for k, t in results["data"]["test_sets"].items()],
    ), "", f"Shared classes (2+ sites): {', '.join(results['data']['shared_classes']) or 'none'}.", ""]

    out += ["## Mean AUROC, all classes (papers' Tables 1 and 2)", "",
            f"Mean ± SD over classes; marks: paired t-test of per-class AUROCs against {ref_label}.", ""]
    cols = site_views + ext_views
    rows = [[d["label"]] + [_cell(d["test"][v], _p(d["test"][v]), with_p=name != ref) for v in cols]
            for name, d in methods.items()]
    out += [_table(["method"] + [f"{v} ({'test split' if v in site_views else 'external'})" for v in cols], rows), ""]

    if len(site_views) > 1:
        out += ["## Shared vs unique classes on each site's test split (papers' Table 3)", ""]
        header = ["method"]
        for v in site_views:
            header += [f"{v} shared", f"{v} unique"]
        rows = []
        for name, d in methods.items():
            row = [d["label"]]
            for v in site_views:
                cell = d["test"][v]
                row += [_cell(cell.get("shared")), _cell(cell.get("unique"))]
            rows.append(row)
        out += [_table(header, rows), "", "(no marks: the t-test is over all classes of the site, see above)", ""]
    if by_site:
        out += ["## External set by each site's classes (papers' Table 4)", ""]
        rows = [[d["label"]] + [_cell(d["test"][v], _p(d["test"][v]), with_p=name != ref) for v in by_site]
                for name, d in methods.items()]
        out += [_table(["method"] + [f"{v.split('@')[0]}, {v.split('@')[1]} classes" for v in by_site], rows), ""]

    if summary:
        out += _targets_section(results)
        return _shift(out, heading)
    out += ["## Mean AUROC with 95 % bootstrap interval, SD over seeds and tests", "",
            "CI: percentile interval of the mean over classes, test images resampled (replicates pooled over seeds). "
            "p: paired t-test of per-class AUROCs against the reference; Shapiro: Shapiro-Wilk p of the differences.", ""]
    for v in cols:
        rows = []
        for name, d in methods.items():
            cell = d["test"][v]
            pt = cell.get("p_vs_reference") or {}
            ci = cell.get("mean_ci")
            rows.append([d["label"], _num(cell["mean"]), "-" if not ci else f"{ci[0]:.3f} - {ci[1]:.3f}",
                         _num(cell.get("mean_seed_sd")), ", ".join(_num(x) for x in cell["mean_by_seed"]),
                         _num(pt.get("p"), 4), _num(pt.get("shapiro_p"), 3), str(pt.get("n", "-"))])
        out += [f"### {v}", "", _table(["method", "mean", "95% CI", "SD over seeds", "per seed", "p", "Shapiro", "classes paired"], rows), ""]

    out += ["## Per-class AUROC (mean over seeds)", ""]
    for v in cols:
        names = list(methods)
        classes = results["views"][v]["classes"]
        rows = []
        for c in classes:
            row = [c]
            for name in names:
                a = methods[name]["test"][v]
                val = a["auroc"].get(c)
                if val is None:
                    row.append("n/a" if c not in a["model_knows"] else "undef")
                else:
                    ci = a["ci"].get(c)
                    row.append(f"{val:.3f}" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci and name == ref else ""))
            rows.append(row)
        out += [f"### {v}", "", _table(["class"] + [methods[n]["label"] for n in names], rows), "",
                "n/a: the model does not predict the class (not defined); undef: one label value only in the test set.", ""]

    out += _targets_section(results)
    if results.get("plots"):
        out += ["## Plots", ""] + [f"![{p}]({p})" for p in results["plots"]] + [""]
    out += ["## Runs", "", _table(
        ["method", "seconds per seed", "best round per seed", "images/s per site"],
        [[d["label"], ", ".join(f"{r['seconds']:.0f}" for r in d["runs"]), ", ".join(str(r["best_round"]) for r in d["runs"]),
          ", ".join(f"{r['images_per_second']:.0f}" for r in d["runs"])] for d in methods.values()],
    ), ""]
    return _shift(out, heading)


def _shift(lines: list[str], heading: str) -> str:
    extra = "#" * (len(heading) - 1)
    return "\n".join(extra + line if line.startswith("#") else line for line in lines)


def _targets_section(results: dict[str, Any]) -> list[str]:
    targets = results.get("targets") or []
    if not targets:
        return []
    out = ["## Targets", ""]
    if not targets[0].get("binding"):
        out += ["(The issue sets these targets for the two-hospitals profiles; shown here for information.)", ""]
    out += ["- " + target_sentence(t, results["methods"]) for t in targets]
    return out + [""]


def target_sentence(t: dict[str, Any], methods: dict[str, Any]) -> str:
    """One sentence per target: met or not, by how much.

    Args:
        t: a target record from :func:`cxrfl.bench.compare.evaluate_targets`.
        methods: the results' methods (for labels).
    """
    a = methods[t["method"]]["label"]
    b = methods[t["against"]]["label"]
    part = f" ({t['part']} classes)" if t.get("part") else ""
    where = f"on `{t['view']}`{part}"
    if t["met"] is None:
        return f"{t['target']} {where}: not measurable ({a} {_num(t['value'])}, {b} {_num(t['other'])})."
    verdict = "MET" if t["met"] else "NOT MET"
    p = "" if t.get("p") is None else f", paired t-test over the {t['part'] + ' ' if t.get('part') else ''}classes p = {t['p']:.3g}"
    return (f"{t['target']} {where}: **{verdict}** — {a} {t['value']:.3f} vs {b} {t['other']:.3f}, "
            f"difference {t['difference']:+.3f} (rule {t['rule']}{p}).")


def format_ablation(summary: dict[str, Any]) -> str:
    """The Markdown table of an ablation (mean AUROC on the held-out test set per setting).

    Args:
        summary: what :func:`cxrfl.bench.compare.run_ablation` writes to ``ablation.json``.
    """
    values = [str(v) for v in summary["values"]]
    names = list(next(iter(summary["runs"].values())))
    what = "number of sites" if summary["ablation"] == "sites" else "number of shared classes (4 sites)"
    rows = []
    for name in names:
        label = summary["runs"][values[0]][name]["label"]
        row = [label]
        for v in values:
            r = summary["runs"][v].get(name, {})
            row.append(f"{_num(r.get('mean'))} {stars(r.get('p_vs_reference'))}".strip())
        rows.append(row)
    return "\n".join([f"# Ablation: {what} ({summary['profile']})", "",
                      "Mean AUROC on the held-out fully annotated test set; marks: paired t-test against surgical aggregation.", "",
                      _table(["method"] + values, rows), ""])
