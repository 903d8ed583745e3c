"""PNG plots of a comparison (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.metrics import roc_curve  # noqa: E402


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
    for i, (name, d) in enumerate(methods.items()):
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


def roc_curves(results: dict[str, Any], entries: dict[str, Any], tests: dict[str, Any], view: str, path: Path) -> None:
    """ROC curves (seed 0) of every single-global-model method on one view: one panel per method,
    a thin curve per class and the macro average.

    Args:
        results: comparison results.
        entries: the comparison's entries (scores per view and seed).
        tests: the test sets.
        view: the view name.
        path: PNG file.
    """
    d = results["views"][view]
    test = tests[d["test"]]
    cols = [test.classes.index(c) for c in d["classes"]]
    labels = test.labels[:, cols]
    names = [n for n, m in results["methods"].items() if m["single_global_model"]]
    if not names:
        return
    ncol = min(3, len(names))
    nrow = int(np.ceil(len(names) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(4 * ncol, 3.8 * nrow), squeeze=False)
    grid = np.linspace(0, 1, 101)
    for ax, name in zip(axes.ravel(), names):
        scores, _ = entries[name].scores[view][0]
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
        mean = results["methods"][name]["test"][view]["mean"]
        ax.set_title(f"{results['methods'][name]['label']} (mean AUROC {mean:.3f})" if mean is not None else
                     results["methods"][name]["label"], fontsize=9)
        ax.set_xlabel("false positive rate", fontsize=8)
        ax.set_ylabel("true positive rate", fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    for ax in axes.ravel()[len(names):]:
        ax.axis("off")
    fig.suptitle(f"{results['profile']}: ROC curves of the global models on {view} (seed 0, one curve per class)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def learning_curves(results: dict[str, Any], path: Path) -> None:
    """Learning curves: the sites' mean validation BCE and mean validation AUROC of the model of
    each round (mean over seeds) for every method.

    Args:
        results: comparison results (each run's ``val_loss`` and ``val_auroc``).
        path: PNG file.
    """
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in ((axes[0], "val_loss", "mean validation BCE of the sites"),
                           (axes[1], "val_auroc", "mean validation AUROC of the sites")):
        for d in results["methods"].values():
            hist = [r.get(key) or [] for r in d["runs"]]
            length = max((len(h) for h in hist), default=0)
            if not length:
                continue
            arr = np.full((len(hist), length), np.nan)
            for i, h in enumerate(hist):
                arr[i, : len(h)] = [np.nan if v is None else v for v in h]
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # a round no seed reached: NaN, not drawn
                mean = np.nanmean(arr, axis=0)
            ax.plot(range(length), mean, marker=".", label=d["label"])
        ax.set_xlabel("model of round (0 = after the head warm-up)")
        ax.set_ylabel(label)
    axes[0].set_title(f"{results['profile']}: validation loss per round (mean over seeds)", fontsize=9)
    axes[1].set_title("validation AUROC per round (mean over seeds)", fontsize=9)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(results: dict[str, Any], entries: dict[str, Any], tests: dict[str, Any], views: list[Any], out: Path) -> list[str]:
    """Every plot of a comparison; returns their file names (relative to ``out``).

    Args:
        results: comparison results.
        entries: the comparison's entries.
        tests: the test sets.
        views: the views.
        out: output folder.
    """
    files = []
    for v in views:
        if v.kind == "external-by-site":
            continue
        name = f"auroc_{_safe(v.name)}.png"
        auroc_by_method(results, v.name, out / name)
        files.append(name)
    roc_view = next((v.name for v in views if v.kind == "external"), views[0].name if views else None)
    if roc_view is not None:
        name = f"roc_{_safe(roc_view)}.png"
        roc_curves(results, entries, tests, roc_view, out / name)
        if (out / name).is_file():
            files.append(name)
    learning_curves(results, out / "val_loss.png")
    files.append("val_loss.png")
    return files


def ablation_plot(summary: dict[str, Any], path: Path) -> None:
    """Mean AUROC per ablation setting and method (the papers' Figure 6).

    Args:
        summary: the ablation summary.
        path: PNG file.
    """
    values = summary["values"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(next(iter(summary["runs"].values())))
    for name in names:
        ys = [summary["runs"][str(v)].get(name, {}).get("mean") for v in values]
        ys = [np.nan if y is None else y for y in ys]
        ax.plot(values, ys, marker="o", label=summary["runs"][str(values[0])][name]["label"])
    ax.set_xlabel("number of sites" if summary["ablation"] == "sites" else "number of shared classes (4 sites)")
    ax.set_ylabel("mean AUROC, held-out test set")
    ax.set_title(f"ablation on {summary['profile']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
