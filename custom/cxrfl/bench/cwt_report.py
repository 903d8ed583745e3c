"""The CWT benchmark's summary, targets with paired statistics, tables, ``report.md`` and plots.

Per dataset (the real NIH images, the synthetic cohort): accuracy (threshold 0.5) and AUROC per
method and split (mean +- SD over seeds), the percent of central accuracy (as the paper reports
its gaps), and the issue's targets as paired comparisons over seeds (same seed: same partition,
same initial weights): mean difference, 95 % CI, Cohen's d_z and t-test p-values
(:mod:`cxrfl.bench.paired`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cxrfl.bench.cwt_data import TABLE_1, TABLE_3
from cxrfl.bench.paired import against, format_stats, paired
from cxrfl.bench.protocol import code_label, load_text
from cxrfl.bench.report_text import markdown_table

CENTRAL = "Central hosting"
CENTRAL_SPLIT = "all"
"""The split key of central hosting in ``results.json`` (one site holding every training image)."""
METHODS: dict[str, dict[str, bool]] = {
    "CWT": {},
    "CWT+PLTI": {"plti": True},
    "CWT+CLR": {"clr": True},
    "CWT+LWMS": {"lwms": True},
    "CWT+CWL": {"cwl": True},
}
SPLIT_METHODS = {
    **{s: ("CWT", "CWT+PLTI", "CWT+CLR") for s in TABLE_1},
    **{s: ("CWT", "CWT+LWMS", "CWT+CWL") for s in TABLE_3},
}
COLORS = {
    CENTRAL: "black",
    "CWT": "tab:red",
    "CWT+PLTI": "tab:blue",
    "CWT+CLR": "tab:green",
    "CWT+LWMS": "tab:purple",
    "CWT+CWL": "tab:orange",
}
DATASET_TITLES = {
    "nih1000": "real NIH images (../shared/data/nih1000)",
    "synthetic": "synthetic NIH-like cohort (cxrfl.synth)",
}
CENTRAL_AUROC_TARGET = {"synthetic": 0.7}
"""The issue's bar for central hosting's AUROC (the real images: above chance)."""


def _mean_sd(values: Sequence[float]) -> dict[str, Any]:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return {
        "mean": float(np.mean(v)) if v else None,
        "sd": float(np.std(v, ddof=1)) if len(v) > 1 else None,
        "n": len(v),
    }


def results_table(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per method and split (central hosting: split ``all``): accuracy and AUROC, mean, SD and per seed.

    Args:
        runs: one record per (seed, split, method) of one dataset, central runs with split 0.
    """
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for method in [CENTRAL, *METHODS]:
        for split in sorted({r["split"] for r in runs if r["method"] == method}):
            rs = sorted((r for r in runs if r["method"] == method and r["split"] == split), key=lambda r: r["seed"])
            acc, auc = _mean_sd([r["accuracy"] for r in rs]), _mean_sd([r["auroc"] for r in rs])
            table.setdefault(method, {})[CENTRAL_SPLIT if split == 0 else str(split)] = {
                "accuracy_mean": acc["mean"],
                "accuracy_sd": acc["sd"],
                "auroc_mean": auc["mean"],
                "auroc_sd": auc["sd"],
                "n_seeds": len(rs),
                "per_seed": {
                    str(r["seed"]): {
                        k: r.get(k)
                        for k in ("accuracy", "auroc", "best_cycle", "cycles_run", "stopped_early", "same_as")
                    }
                    for r in rs
                },
            }
    return table


def _by_seed(runs: Sequence[dict[str, Any]], split: int, method: str, metric: str) -> dict[str, float]:
    return {str(r["seed"]): r[metric] for r in runs if r["split"] == split and r["method"] == method}


def _closer(runs: Sequence[dict[str, Any]], split: int, a: str, b: str, metric: str) -> dict[str, Any]:
    """How much closer ``b`` is to central hosting than ``a`` per seed: ``|c - a| - |c - b|`` (> 0: closer)."""
    cen, xa, xb = (_by_seed(runs, s, m, metric) for s, m in ((0, CENTRAL), (split, a), (split, b)))
    seeds = sorted(set(cen) & set(xa) & set(xb))
    gap_a = {s: abs(cen[s] - xa[s]) for s in seeds}
    gap_b = {s: abs(cen[s] - xb[s]) for s in seeds}
    gaps = {m: _mean_sd([cen[s] - x[s] for s in seeds]) for m, x in ((a, xa), (b, xb))}
    return {**paired(gap_b, gap_a), "gap_to_central": gaps}


def _targets(runs: Sequence[dict[str, Any]], dataset: str, splits: Sequence[int]) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    auc = _by_seed(runs, 0, CENTRAL, "auroc")
    bar = CENTRAL_AUROC_TARGET.get(dataset)
    if bar is not None:
        st = against(auc, bar)
        targets["central_auroc"] = {
            "target": f"central hosting AUROC >= {bar:.2f}",
            "met": st["difference"] is not None and st["difference"] >= 0,
            "stats": st,
        }
    else:
        st = against(auc, 0.5)
        targets["central_auroc"] = {
            "target": "central hosting AUROC above chance (0.5; one-sided p < 0.05 over seeds)",
            "met": st["p_one_sided"] is not None and st["p_one_sided"] < 0.05,
            "stats": st,
        }
    if 5 in splits:
        t = {m: _closer(runs, 5, "CWT", "CWT+PLTI", m) for m in ("accuracy", "auroc")}
        t["target"] = "split 5: CWT+PLTI closer to central hosting (accuracy) than vanilla CWT"
        targets["split5_plti"] = _verdict(t)
    if 10 in splits:
        for m in ("CWT+LWMS", "CWT+CWL"):
            t = {k: paired(_by_seed(runs, 10, "CWT", k), _by_seed(runs, 10, m, k)) for k in ("accuracy", "auroc")}
            t["target"] = f"split 10: {m} above vanilla CWT (accuracy)"
            targets[f"split10_{m.split('+')[1].lower()}"] = _verdict(t)
    return targets


def _verdict(t: dict[str, Any]) -> dict[str, Any]:
    """A comparison target: met where the mean paired accuracy difference is above 0, significant where
    its one-sided p-value is below 0.05 too.

    Args:
        t: the target's paired statistics (``accuracy``, ``auroc``) and its ``target`` text.
    """
    acc = t["accuracy"]
    t["met"] = acc["difference"] is not None and acc["difference"] > 0
    t["significant"] = t["met"] and acc["p_one_sided"] is not None and acc["p_one_sided"] < 0.05
    return t


def _trained(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs this benchmark trained: not those reported as another, identical run (``same_as``)."""
    return [r for r in runs if not r.get("same_as")]


def stopping(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How the trained runs ended: early stopping, or the cycle cap while the validation loss still fell.

    Args:
        runs: one record per (seed, split, method); runs reported as another one (``same_as``) are not counted.
    """
    trained = _trained(runs)
    capped = sorted(
        (r for r in trained if not r.get("stopped_early")), key=lambda r: (r["split"], r["method"], r["seed"])
    )
    return {
        "trained_runs": len(trained),
        "stopped_early": len(trained) - len(capped),
        "reached_cap": [{k: r.get(k) for k in ("method", "split", "seed", "best_cycle", "cycles_run")} for r in capped],
    }


def summarise(
    runs: list[dict[str, Any]], dataset: str, splits: Sequence[int], test_images: int, seeds: int
) -> dict[str, Any]:
    """Mean +- SD per split and method, percent of central accuracy, the issue's targets, how runs stopped.

    Args:
        runs: one record per (seed, split, method) of one dataset, central runs with split 0.
        dataset: ``nih1000`` or ``synthetic`` (which central-hosting target applies).
        splits: the splits run.
        test_images: test set size (the noise estimate).
        seeds: seeds asked for.
    """
    central = [r for r in runs if r["method"] == CENTRAL]
    c_acc, c_auc = _mean_sd([r["accuracy"] for r in central]), _mean_sd([r["auroc"] for r in central])
    table: dict[str, Any] = {"central": {"accuracy": c_acc, "auroc": c_auc}, "splits": {}}
    for split in splits:
        row = {}
        for method in SPLIT_METHODS[split]:
            rs = [r for r in runs if r["split"] == split and r["method"] == method]
            acc, auc = _mean_sd([r["accuracy"] for r in rs]), _mean_sd([r["auroc"] for r in rs])
            pct = 100.0 * acc["mean"] / c_acc["mean"] if acc["mean"] is not None and c_acc["mean"] else None
            row[method] = {
                "accuracy": acc,
                "auroc": auc,
                "percent_of_central_accuracy": pct,
                "reused": sorted({r["same_as"] for r in rs if r.get("same_as")}),
            }
        table["splits"][str(split)] = row
    table["targets"] = _targets(runs, dataset, splits)
    table["stopping"] = stopping(runs)
    acc = c_acc["mean"] or 0.5
    table["noise"] = {
        "test_images": test_images,
        "binomial_sd_of_accuracy": math.sqrt(acc * (1 - acc) / test_images),
        "seeds": seeds,
    }
    return table


# ------------------------------------------------------------------------------------- plots
def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    """Test accuracy and AUROC per split, mean +- SD over seeds, like the paper's Figures 3-4.

    Args:
        summary: output of :func:`summarise`.
        path: the PNG to write.
        title: what the images are.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row")
    groups = [
        ("A: sample-size variability (Table 1)", [s for s in TABLE_1 if str(s) in summary["splits"]]),
        ("B: label-distribution variability (Table 3)", [s for s in TABLE_3 if str(s) in summary["splits"]]),
    ]
    for col, (name, splits) in enumerate(groups):
        if not splits:
            continue
        for row, metric in enumerate(("accuracy", "auroc")):
            ax = axes[row][col]
            c = summary["central"][metric]
            if c["mean"] is not None:
                ax.axhline(c["mean"], color=COLORS[CENTRAL], lw=1.2, label=f"{CENTRAL} (same images)")
                if c["sd"]:
                    ax.axhspan(c["mean"] - c["sd"], c["mean"] + c["sd"], color="grey", alpha=0.15)
            for k, m in enumerate(SPLIT_METHODS[splits[0]]):
                ys = [summary["splits"][str(s)][m][metric] for s in splits]
                x = np.arange(len(splits)) + (k - 1) * 0.12
                ax.errorbar(
                    x,
                    [y["mean"] for y in ys],
                    yerr=[y["sd"] or 0 for y in ys],
                    fmt="o-",
                    capsize=3,
                    color=COLORS[m],
                    label=m,
                )
            ax.set_xticks(np.arange(len(splits)), [str(s) for s in splits])
            ax.set_xlabel("split")
            ax.set_ylabel(f"test {'accuracy' if metric == 'accuracy' else 'AUROC'}")
            if row == 0:
                ax.set_title(name)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower left")
    fig.suptitle(f"Cyclical weight transfer on the {title} (abnormal vs no finding), mean +- SD over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(runs: Sequence[dict[str, Any]], splits: Sequence[int], path: Path) -> None:
    """Pooled validation loss per cycle (mean over seeds) of central hosting and each method at some splits.

    Args:
        runs: the run records (with ``val_curve``) of one dataset.
        splits: the splits to draw (the most unequal of each table by default: 5 and 10).
        path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean_curve(rs: list[dict[str, Any]]) -> list[float]:
        n = max((len(r.get("val_curve") or []) for r in rs), default=0)
        return [
            float(np.nanmean([r["val_curve"][i] for r in rs if len(r.get("val_curve") or []) > i])) for i in range(n)
        ]

    fig, axes = plt.subplots(1, max(len(splits), 1), figsize=(5.5 * max(len(splits), 1), 4), squeeze=False)
    central = [r for r in runs if r["method"] == CENTRAL and r.get("val_curve")]
    for ax, split in zip(axes[0], splits):
        if central:
            ax.plot(range(1, len(mean_curve(central)) + 1), mean_curve(central), "k-", label=CENTRAL)
        for m in SPLIT_METHODS[split]:
            rs = [r for r in runs if r["method"] == m and r["split"] == split and r.get("val_curve")]
            if rs:
                ax.plot(range(1, len(mean_curve(rs)) + 1), mean_curve(rs), "o-", color=COLORS[m], label=m)
        ax.set_title(f"split {split}")
        ax.set_xlabel("cycle")
        ax.set_ylabel("pooled validation loss (mean over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------- markdown
def result_tables(summary: dict[str, Any]) -> str:
    """The result tables in Markdown: test accuracy and AUROC (mean +- SD) and percent of central accuracy.

    Args:
        summary: output of :func:`summarise`.
    """

    def f(x: dict[str, Any]) -> str:
        if x["mean"] is None:
            return "n/a"
        return f"{100 * x['mean']:.1f} +- {100 * x['sd']:.1f}" if x["sd"] is not None else f"{100 * x['mean']:.1f}"

    c = summary["central"]
    lines = []
    for title, table in (
        ("Sample-size variability (Table 1 splits)", TABLE_1),
        ("Label-distribution variability (Table 3 splits)", TABLE_3),
    ):
        splits = [s for s in table if str(s) in summary["splits"]]
        if not splits:
            continue
        methods = SPLIT_METHODS[splits[0]]
        rows = []
        for s in splits:
            row = summary["splits"][str(s)]
            cells = [str(s), f"{f(c['accuracy'])} / {f(c['auroc'])}"]
            for m in methods:
                r = row[m]
                pct = r["percent_of_central_accuracy"]
                same = f" [= {', '.join(r['reused'])}]" if r["reused"] else ""
                cells.append(f"{f(r['accuracy'])} / {f(r['auroc'])} ({pct:.1f}%){same}" if pct is not None else "n/a")
            rows.append(cells)
        lines += [
            f"**{title}** - test accuracy % / AUROC x 100, mean +- SD over seeds; (% of central accuracy)",
            "",
            markdown_table(["split", CENTRAL, *methods], rows),
            "",
        ]
    return "\n".join(lines)


def _target_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for key, t in summary["targets"].items():
        verdict = f"**{'met' if t['met'] else 'not met'}**"
        if key == "central_auroc":
            c = summary["central"]["auroc"]
            lines.append(
                f"- {t['target']}: {verdict} (mean AUROC {c['mean']:.3f}; against {t['stats']['reference']}: "
                f"{format_stats(t['stats'])})"
                if c["mean"] is not None
                else f"- {t['target']}: n/a"
            )
            continue
        if t["met"]:
            verdict += (
                ", significant (one-sided p < 0.05)"
                if t["significant"]
                else " in the mean, not significant (one-sided p >= 0.05)"
            )
        what = "how much closer to central hosting" if key == "split5_plti" else "paired difference"
        lines.append(
            f"- {t['target']}: {verdict} ({what}, accuracy: {format_stats(t['accuracy'], 100, ' points')}; "
            f"AUROC: {format_stats(t['auroc'], 100, ' points')})"
        )
    return lines


def stopping_line(stop: dict[str, Any], patience: int) -> str:
    """The report's line on how the runs stopped, naming each run that reached the cycle cap.

    Args:
        stop: :func:`stopping` of one dataset.
        patience: cycles without a lower validation loss that stopped a run.
    """
    line = (
        f"- Stopping: {stop['stopped_early']} of {stop['trained_runs']} trained runs stopped after {patience} "
        "cycles without a lower validation loss"
    )
    capped = stop["reached_cap"]
    if not capped:
        return line + "; none reached the cycle cap."
    where = "; ".join(
        ("central hosting" if r["split"] == 0 else f"split {r['split']} {r['method']}")
        + f" seed {r['seed']} (best cycle {r['best_cycle']} of {r['cycles_run']})"
        for r in capped
    )
    return line + f"; {len(capped)} reached the cycle cap with the loss still falling: {where}."


def dataset_markdown(name: str, part: dict[str, Any], patience: int) -> list[str]:
    """One dataset's section of ``report.md``.

    Args:
        name: ``nih1000`` or ``synthetic``.
        part: ``results.json``'s ``datasets[name]``.
        patience: cycles without a lower validation loss that stopped a run.
    """
    data, summary = part["data"], part["summary"]
    noise = summary["noise"]
    lines = [
        f"## {DATASET_TITLES.get(name, name)}",
        "",
        f"- Data: {data['source']}: test {data['test_images']}, validation {data['val_images']}, training "
        f"{data['train_images']} images ({data['train_patients']} patients; {data['train_images'] // 2} abnormal + as "
        f"many normal), split counts {json.dumps(data['splits'])}",
        f"- Noise: {noise['test_images']} test images give a binomial SD of about "
        f"{100 * noise['binomial_sd_of_accuracy']:.1f} accuracy points per run; {noise['seeds']} seeds.",
        stopping_line(summary["stopping"], patience),
        "",
        result_tables(summary),
        "### Targets",
        "",
        *_target_lines(summary),
        "",
        f"![test accuracy and AUROC per split]({part['plots'][0]})",
        "",
        f"![pooled validation loss per cycle]({part['plots'][1]})",
        "",
    ]
    return lines


def provenance(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Which code and machines trained the runs, and their summed training time.

    A benchmark that goes on across sessions trains its runs under several invocations (and perhaps
    commits); each trained run keeps the ``code`` and ``machine`` of the process that trained it.
    Runs reported as another one (``same_as``) are not counted.

    Args:
        runs: every run record of ``results.json``.
    """
    trained = _trained(runs)
    code: dict[tuple[str, bool], int] = {}
    machines: dict[str, int] = {}
    for r in trained:
        c = r.get("code") or {}
        key = ((c.get("commit") or "unknown")[:7], bool(c.get("dirty")))
        code[key] = code.get(key, 0) + 1
        m = r.get("machine")
        where = f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch thread(s)" if m else "not recorded"
        machines[where] = machines.get(where, 0) + 1
    return {
        "trained_runs": len(trained),
        "reused_runs": len(runs) - len(trained),
        "training_seconds": round(sum(r["seconds"] for r in trained), 1),
        "code": [{"commit": c, "dirty": d, "runs": n} for (c, d), n in code.items()],
        "machines": [{"machine": m, "runs": n} for m, n in machines.items()],
    }


def _provenance_lines(result: dict[str, Any]) -> list[str]:
    prov = result["provenance"]
    code = "; ".join(f"{code_label(c)} ({c['runs']} runs)" for c in prov["code"])
    where = "; ".join(f"{m['machine']} ({m['runs']} runs)" for m in prov["machines"])
    jobs = result["settings"].get("jobs", 1)
    return [
        f"- Code: {code}",
        f"- Machine: {where}",
        f"- Time: {prov['trained_runs']} runs trained ({prov['reused_runs']} more reported as an identical run), "
        f"{prov['training_seconds'] / 3600:.1f} h of run time in {jobs} parallel process(es), so about "
        f"{prov['training_seconds'] / 3600 / jobs:.1f} h of wall time; the last invocation {result['seconds']:.0f} s "
        f"(load average at its start {load_text(result['machine'])})",
    ]


def report_markdown(result: dict[str, Any]) -> str:
    """``report.md``: what ran and where, per dataset the result tables, the targets with paired statistics, the plots.

    Args:
        result: the content of ``results.json``.
    """
    machine = result["machine"]
    lines = [
        "# Cyclical weight transfer: the paper's splits 1-10",
        "",
        f"- Command: `{result['command']}`",
        *_provenance_lines(result),
        f"- Software: {machine['platform']}, Python {machine['python']}, torch {machine['torch']}",
        f"- Settings: `{json.dumps(result['settings'])}`",
        "- Targets are paired over seeds (same seed: same partition, same initial weights): mean difference "
        "[95% CI], Cohen's d_z, t-test p-values.",
        "",
    ]
    for name, part in result["datasets"].items():
        lines += dataset_markdown(name, part, result["settings"]["patience"])
    return "\n".join(lines)
