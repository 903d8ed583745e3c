"""PNG plots of a comparison (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator
from sklearn.metrics import roc_curve


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def auroc_by_method(results: dict[str, Any], view: str, path: Path) -> None:
    """Per-class AUROC (mean over seeds) of every method on one view, one marker row per method.

    Args:
        results: comparison results.
        view: the view name.
        path: PNG file.
    """
    classes = results["views"][view]["classes"]
    methods = results["methods"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(classes) + 3), 4.5))
    n = len(methods)
    markers = "os^vD<>pP*hX"
    for i, d in enumerate(methods.values()):
        a = d["test"][view]["auroc"]
        xs = [j + (i - (n - 1) / 2) * 0.06 for j, c in enumerate(classes) if a.get(c) is not None]
        ys = [a[c] for c in classes if a.get(c) is not None]
        if ys:
            ax.plot(xs, ys, markers[i % len(markers)], label=d["label"], markersize=5, alpha=0.85)
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(classes)))
    ax.set_xticklabels(classes, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("AUROC (mean over seeds)")
    ax.set_title(f"{results['profile']}: per-class AUROC on {view}")
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def roc_curves(results: dict[str, Any], tests: dict[str, Any], store: Any, view: str, path: Path) -> None:
    """ROC curves (first reported seed) of every single-global-model method on one view: one panel
    per method, a thin curve per class and the macro average.

    Args:
        results: comparison results.
        tests: the test sets.
        store: the stored runs (:class:`cxrfl.bench.runs.RunStore`: their scores).
        view: the view name.
        path: PNG file.
    """
    d = results["views"][view]
    test = tests[d["test"]]
    cols = [test.classes.index(c) for c in d["classes"]]
    labels = test.labels[:, cols]
    seed = results["seeds"][0]
    panels = []
    for name, m in results["methods"].items():
        scores = store.scores(name, seed) if m["single_global_model"] else None
        if scores is not None and f"{d['test']}|*" in scores:
            panels.append((name, scores[f"{d['test']}|*"][:, cols]))
    if not panels:
        return
    ncol = min(3, len(panels))
    nrow = int(np.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(4 * ncol, 3.8 * nrow), squeeze=False)
    grid = np.linspace(0, 1, 101)
    for ax, (name, scores) in zip(axes.ravel(), panels):
        tprs = []
        for j in range(len(cols)):
            y, s = labels[:, j], scores[:, j]
            ok = ~np.isnan(y) & ~np.isnan(s)
            if ok.sum() == 0 or len(np.unique(y[ok])) < 2:
                continue
            fpr, tpr, _ = roc_curve(y[ok], s[ok])
            ax.plot(fpr, tpr, lw=0.6, alpha=0.4)
            tprs.append(np.interp(grid, fpr, tpr))
        if tprs:
            ax.plot(grid, np.mean(tprs, axis=0), color="black", lw=2, label="macro average")
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":")
        method = results["methods"][name]
        mean = method["test"][view]["mean"]
        ax.set_title(f"{method['label']} (mean AUROC {mean:.3f})" if mean is not None else method["label"], fontsize=9)
        ax.set_xlabel("false positive rate", fontsize=8)
        ax.set_ylabel("true positive rate", fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    for ax in axes.ravel()[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        f"{results['profile']}: ROC curves of the global models on {view} (seed {seed}, one curve per class)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves_by(
    runs: Sequence[Mapping[str, Any]], key: str, groups: Sequence[str], title: str, seeds: int, path: Path
) -> None:
    """:func:`learning_curves` of runs grouped by one of their fields, one colour per group.

    Args:
        runs: the runs (each with ``key``, ``val_loss``, ``val_auroc`` and ``best_round``).
        key: the field that groups them (``profile``, ``format``, ``option`` ...).
        groups: its values, in the legend's order.
        title: the plot's title.
        seeds: seeds per group.
        path: PNG file.
    """
    methods = {g: {"label": g, "runs": [r for r in runs if r[key] == g]} for g in groups}
    learning_curves({"profile": title, "seeds": list(range(seeds)), "methods": methods}, path)


def learning_curves(results: dict[str, Any], path: Path) -> None:
    """Learning curves of every run: the sites' mean validation BCE and mean validation AUROC of the
    model of each round (one thin line per seed, the method's colour), the selected round marked,
    so that one can see every model converge and stop.

    Args:
        results: comparison results (each run's ``curve_rounds``, ``val_loss``, ``val_auroc``, ``best_round``).
        path: PNG file.
    """
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # repeats after 10 methods: lines then dash
    for i, d in enumerate(results["methods"].values()):
        colour = colours[i % len(colours)]
        for k, run in enumerate(d["runs"]):
            xs = run.get("curve_rounds") or list(range(len(run.get("val_loss") or [])))
            for ax, key in ((axes[0], "val_loss"), (axes[1], "val_auroc")):
                ys = [np.nan if v is None else v for v in run.get(key) or []]
                if not ys:
                    continue
                ax.plot(
                    xs,
                    ys,
                    color=colour,
                    lw=0.9,
                    alpha=0.7,
                    ls="-" if i < len(colours) else "--",
                    label=d["label"] if k == 0 else None,
                )
                if run.get("best_round") in xs:
                    j = xs.index(run["best_round"])
                    ax.plot([xs[j]], [ys[j]], "o", color=colour, markersize=4)
    for ax, label in ((axes[0], "mean validation BCE of the sites"), (axes[1], "mean validation AUROC of the sites")):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("model of round (0 = after the head warm-up; epoch for one-site baselines)")
        ax.set_ylabel(label)
    n = len(results.get("seeds") or [])
    axes[0].set_title(f"{results['profile']}: validation loss per round, {n} seed(s); dots: selected round", fontsize=9)
    axes[1].set_title("validation AUROC per round", fontsize=9)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(results: dict[str, Any], tests: dict[str, Any], store: Any, out: Path) -> list[str]:
    """Every plot of a comparison; returns their file names (relative to ``out``).

    Args:
        results: comparison results.
        tests: the test sets.
        store: the stored runs (their scores, for the ROC curves).
        out: output folder.
    """
    files = []
    views = results["views"]
    for name, v in views.items():
        if v["kind"] == "external-by-site":
            continue
        file = f"auroc_{_safe(name)}.png"
        auroc_by_method(results, name, out / file)
        files.append(file)
    roc_view = next((name for name, v in views.items() if v["kind"] == "external"), next(iter(views), None))
    if roc_view is not None:
        file = f"roc_{_safe(roc_view)}.png"
        roc_curves(results, tests, store, roc_view, out / file)
        if (out / file).is_file():
            files.append(file)
    learning_curves(results, out / "learning_curves.png")
    files.append("learning_curves.png")
    return files


def ablation_plot(summary: dict[str, Any], path: Path) -> None:
    """Mean AUROC on the held-out test set per ablation setting and method, with the SD over seeds
    (the papers' Figure 6).

    Args:
        summary: the ablation summary (:func:`cxrfl.bench.statistics.ablation_summary`).
        path: PNG file.
    """
    values = summary["values"]
    xs = [float(v) for v in values]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for d in summary["methods"].values():
        means = [d["by_value"][v]["over_seeds"]["mean"] for v in values]
        sds = [d["by_value"][v]["over_seeds"]["sd"] or 0.0 for v in values]
        ys = np.array([np.nan if m is None else m for m in means], dtype=float)
        ax.errorbar(xs, ys, yerr=sds, marker="o", capsize=3, label=d["label"])
    ax.set_xticks(xs)
    ax.set_xticklabels(values)
    sites = summary["ablation"] == "sites"
    ax.set_xlabel("number of sites (4 shared classes)" if sites else "number of shared classes (4 sites)")
    ax.set_ylabel("mean AUROC, held-out test set (mean ± SD over seeds)")
    ax.set_title(f"ablation on {summary['profile']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
