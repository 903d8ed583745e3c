"""The FedFew benchmark's summary (mean and SD over seeds), targets, ``report.md`` and plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cxrfl.bench.fedfew.settings import BASELINES, LABELS, METHODS
from cxrfl.synth.fedfew_profile import FEDFEW_UCS

UC_METRICS = ("accuracy", "precision", "recall", "f1")


def _ms(values: list[float | None]) -> dict[str, float | None]:
    kept = [v for v in values if v is not None and np.isfinite(v)]
    if not kept:
        return {"mean": None, "sd": None, "n": 0}
    return {"mean": float(np.mean(kept)), "sd": float(np.std(kept, ddof=1)) if len(kept) > 1 else None, "n": len(kept)}


def _summarise_method(method: str, rs: list[dict[str, Any]]) -> dict[str, Any]:
    entry: dict[str, Any] = {"label": LABELS[method], "seeds": len(rs), "mean_uc_f1": _ms([r["mean_uc_f1"] for r in rs]),
                             "mean_cc_auroc": _ms([r.get("mean_cc_auroc") for r in rs]), "uc": {}}
    for uc in FEDFEW_UCS:
        entry["uc"][uc] = {k: _ms([r["uc"][uc][k] for r in rs if uc in r["uc"]]) for k in UC_METRICS}
    if method.startswith("fedfew"):
        entry["diagnostics"] = {uc: {k: _ms([r["test_energy"][uc].get(k) for r in rs if uc in r.get("test_energy", {})])
                                     for k in ("energy_auroc", "prototype_margin_auroc")} for uc in FEDFEW_UCS}
        entry["flagged"] = {uc: {k: _ms([r["uc"][uc].get(k) for r in rs if uc in r["uc"]])
                                 for k in ("flagged_positives", "flagged_negatives")} for uc in FEDFEW_UCS}
    return entry


def summarise(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Mean and SD over seeds of every metric of every method, and the target verdicts.

    Args:
        runs: method -> seed (as text) -> that run's results.
    """
    table = {m: _summarise_method(m, list(runs[m].values())) for m in METHODS if runs.get(m)}
    return {"methods": table, "targets": targets(table)}


def targets(table: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets on the ``fedfew`` profile, each with the numbers it is judged on.

    Args:
        table: the summary per method (:func:`summarise`).
    """
    out: dict[str, Any] = {}
    ff = table.get("fedfew")
    if ff is None:
        return out
    f1 = ff["mean_uc_f1"]["mean"]
    out["uc_f1_at_least_0.5"] = {"value": f1, "met": f1 is not None and f1 >= 0.5}
    for b in BASELINES:
        if b not in table:
            continue
        bf1 = table[b]["mean_uc_f1"]["mean"]
        out[f"uc_f1_0.3_above_{b}"] = {"fedfew": f1, "baseline": bf1, "difference": (f1 - bf1) if None not in (f1, bf1) else None,
                                      "met": None not in (f1, bf1) and f1 - bf1 >= 0.3}
        a, ba = ff["mean_cc_auroc"]["mean"], table[b]["mean_cc_auroc"]["mean"]
        out[f"cc_auroc_within_0.01_of_{b}"] = {"fedfew": a, "baseline": ba, "difference": (a - ba) if None not in (a, ba) else None,
                                              "met": None not in (a, ba) and a >= ba - 0.01}
    return out


# ------------------------------------------------------------------------------------- markdown
def _fmt(x: dict[str, Any] | None, digits: int = 2) -> str:
    if not x or x.get("mean") is None:
        return "-"
    sd = x.get("sd")
    return f"{x['mean']:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")


def _header(result: dict[str, Any], commit: str) -> list[str]:
    s, ff, machine = result["settings"], result["settings"]["fedfew"], result["machine"]
    seeds = result["seeds_done"]
    seed_minutes = sum(r.get("seconds", 0) for by_seed in result["runs"].values() for r in by_seed.values()) / 60
    return [
        f"Command: `{result['command']}`. Commit: {commit}. "
        f"Machine: {machine['cpus']} CPU cores shared with other jobs, {s['threads']} torch thread(s), "
        f"{'a GPU' if machine.get('cuda') else 'no GPU'}; {len(seeds)} seed(s) ({', '.join(map(str, seeds))}), "
        f"{s.get('jobs', 1)} in parallel: {result.get('wall_seconds_total', 0) / 60:.0f} min wall "
        f"({seed_minutes:.0f} min of method time); load average {machine.get('load_average_at_start') or 0:.1f} at the "
        "start (other jobs on the same cores)." + (f" {result['note']}" if result.get("note") else ""),
        "",
        f"Settings: DenseNet121 from scratch at {s['image_size']}x{s['image_size']} (images written at {s['data_image_size']}); "
        f"3 CC sites of {s['n_cc']} images ({s['cc_label_fraction']:.0%} of training images labelled), 3 UC sites of ~220 images "
        f"(~20 positives), 90/10 train/val; UC test sets balanced, up to {s['test_per_class']} positives + as many negatives; "
        f"CC AUROC on all 600 test images. FedFew: {ff['ssl_rounds']} SimSiam round(s) of <= {ff['ssl_max_steps']} steps/site, "
        f"{ff['warmup_rounds']} warm-up + {ff['rounds']} energy round(s) ({ff['local_epochs']} local epoch(s), batch {ff['batch_size']}, "
        f"Adam {ff['lr']}), T={ff['temperature']}, lambda={ff['energy_weight']}, margins from the warm-up (widen "
        f"{ff['margin_widen']}), min {ff['min_prototype_images']} images per prototype, threshold rule "
        f"`{ff['threshold_weighting']}` on `{ff['threshold_examples']}` examples. MLC: {s['mlc_rounds']} rounds x "
        f"{s.get('mlc_local_epochs', 1)} local epoch(s), CheXNet weighted BCE, batch {s['mlc_batch_size']}. These are CPU-sized "
        "settings, far below the paper's (100 SSL epochs, 224 px, thousands of images).",
    ]


def _table(table: dict[str, Any]) -> list[str]:
    lines = ["| Method | " + " | ".join(f"{uc} A / P / R / F1" for uc in FEDFEW_UCS) + " | mean UC F1 | mean CC AUROC |",
             "| --- |" + " --- |" * (len(FEDFEW_UCS) + 2)]
    for m, e in ((m, table[m]) for m in METHODS if m in table):
        cells = [" / ".join(_fmt(e["uc"][uc][k]) for k in UC_METRICS) for uc in FEDFEW_UCS]
        lines.append(f"| {e['label']} | {' | '.join(cells)} | {_fmt(e['mean_uc_f1'])} | {_fmt(e['mean_cc_auroc'], 3)} |")
    lines += ["", "Mean ± SD over seeds. A / P / R / F1: accuracy, precision, recall, F1 of each UC on its balanced test set."]
    if "fedfew-balanced" in table:
        lines.append("\\* Not the paper's rule: the same stage-2 model, stage 3 re-run (through `resume_from`) with "
                     "`threshold_weighting: balanced` instead of the most correctly classified training examples.")
    ff = table.get("fedfew")
    if ff and ff.get("diagnostics"):
        diag = "; ".join(f"{uc} {_fmt(d['energy_auroc'])} / {_fmt(d['prototype_margin_auroc'])}" for uc, d in ff["diagnostics"].items())
        flag = "; ".join(f"{uc} {_fmt(d['flagged_positives'])} / {_fmt(d['flagged_negatives'])}" for uc, d in ff["flagged"].items())
        lines += ["", f"Diagnostics of FedFew w/ EBM on the UC test sets: AUROC of the energy alone / of the prototype margin "
                      f"alone: {diag}. Share of positives / negatives flagged by the energy threshold: {flag}."]
    return lines


def _targets(t: dict[str, Any]) -> list[str]:
    lines = ["", "Targets:", ""]
    if "uc_f1_at_least_0.5" in t:
        v = t["uc_f1_at_least_0.5"]
        lines.append(f"- FedFew mean F1 over the UCs >= 0.5: **{'met' if v['met'] else 'not met'}** ({v['value']:.3f}).")
    for b in BASELINES:
        for key, text in ((f"uc_f1_0.3_above_{b}", f"... at least 0.3 above {LABELS[b]}"),
                          (f"cc_auroc_within_0.01_of_{b}", f"Mean CC AUROC no worse than {LABELS[b]} by more than 0.01")):
            v = t.get(key)
            if v and v["difference"] is not None:
                lines.append(f"- {text}: **{'met' if v['met'] else 'not met'}** ({v['fedfew']:.3f} vs {v['baseline']:.3f}, "
                             f"difference {v['difference']:+.3f}).")
    return lines


def format_markdown(result: dict[str, Any], commit: str | None = None) -> str:
    """The report of a FedFew benchmark (``report.md``; also BENCHMARKS.md's FedFew section).

    Args:
        result: the ``results.json`` written by :func:`cxrfl.bench.fedfew.run.run_fedfew_benchmark`.
        commit: the commit named as the code that ran (default: the one the results name).
    """
    summary = result.get("summary", {})
    lines = ["## FedFew: underrepresented classes held by few sites (synthetic `fedfew` profile)", "",
             *_header(result, commit or result.get("commit") or "unknown"), "", *_table(summary.get("methods", {})), *_targets(summary.get("targets", {}))]
    if result.get("plots"):
        lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in result["plots"]) + "."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- plots
def write_plots(result: dict[str, Any], out: Path) -> list[str]:
    """``uc_f1.png`` (F1 of each UC and the mean, per method) and ``cc_auroc.png`` (mean CC AUROC per method).

    Args:
        result: the benchmark's results (with a summary).
        out: the output folder.

    Returns:
        The file names written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = result.get("summary", {}).get("methods", {})
    methods = [m for m in METHODS if m in table]
    if not methods:
        return []
    groups = [*FEDFEW_UCS, "mean"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        cells = [table[m]["uc"][uc]["f1"] for uc in FEDFEW_UCS] + [table[m]["mean_uc_f1"]]
        x = np.arange(len(groups)) + (i - (len(methods) - 1) / 2) * width
        ax.bar(x, [c["mean"] or 0.0 for c in cells], width, yerr=[c["sd"] or 0.0 for c in cells], capsize=2,
               label=table[m]["label"])
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.set_ylabel("F1 on the balanced UC test set")
    ax.set_ylim(0, 1)
    ax.set_title("FedFew benchmark: UC F1 per method (mean ± SD over seeds)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "uc_f1.png", dpi=110)
    plt.close(fig)
    names = ["uc_f1.png"]
    with_cc = [m for m in methods if table[m]["mean_cc_auroc"]["mean"] is not None]
    if with_cc:
        fig, ax = plt.subplots(figsize=(6, 4))
        cells = [table[m]["mean_cc_auroc"] for m in with_cc]
        ax.bar(range(len(with_cc)), [c["mean"] for c in cells], yerr=[c["sd"] or 0.0 for c in cells], capsize=3)
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_xticks(range(len(with_cc)), [table[m]["label"] for m in with_cc], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("mean CC AUROC (all test images)")
        ax.set_ylim(0, 1)
        ax.set_title("FedFew benchmark: CC AUROC per method")
        fig.tight_layout()
        fig.savefig(out / "cc_auroc.png", dpi=110)
        plt.close(fig)
        names.append("cc_auroc.png")
    return names
