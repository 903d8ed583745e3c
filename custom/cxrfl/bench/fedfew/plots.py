"""The FedFew benchmark's plots: UC F1 and CC AUROC per method, stage 1's probe AUROC per round budget,
learning curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cxrfl.bench.fedfew.report import selection_curve
from cxrfl.bench.fedfew.settings import LABELS, METHODS
from cxrfl.synth.fedfew_profile import FEDFEW_UCS


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _uc_f1(table: dict[str, Any], methods: list[str], path: Path) -> None:
    plt = _pyplot()
    groups = [*FEDFEW_UCS, "mean"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        cells = [table[m]["uc"][uc]["f1"] for uc in FEDFEW_UCS] + [table[m]["mean_uc_f1"]]
        x = np.arange(len(groups)) + (i - (len(methods) - 1) / 2) * width
        ax.bar(
            x,
            [c["mean"] or 0.0 for c in cells],
            width,
            yerr=[c["sd"] or 0.0 for c in cells],
            capsize=2,
            label=table[m]["label"],
        )
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.set_ylabel("F1 on the balanced UC test set")
    ax.set_ylim(0, 1)
    ax.set_title("FedFew benchmark: UC F1 per method (mean ± SD over seeds)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cc_auroc(table: dict[str, Any], methods: list[str], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    cells = [table[m]["mean_cc_auroc"] for m in methods]
    ax.bar(range(len(methods)), [c["mean"] for c in cells], yerr=[c["sd"] or 0.0 for c in cells], capsize=3)
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.axhline(0.7, color="tab:red", lw=0.8, ls="--", label="target 0.70")
    ax.set_xticks(range(len(methods)), [table[m]["label"] for m in methods], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("mean CC AUROC (all test images)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("FedFew benchmark: CC AUROC per method")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _probe(probe: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    rounds = [int(r) for r in probe]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar(
        rounds,
        [probe[str(r)]["mean"] for r in rounds],
        yerr=[probe[str(r)]["sd"] or 0.0 for r in rounds],
        fmt="o-",
        capsize=3,
    )
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("SimSiam rounds (stage 1)")
    ax.set_ylabel("linear-probe mean CC AUROC (CC test set)")
    ax.set_title("FedFew stage 1: do the features separate the findings?")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _learning_curves(runs: dict[str, dict[str, Any]], path: Path) -> bool:
    """Validation loss and CC validation AUROC per round of every trained method and seed, the kept round marked.

    Returns:
        whether any run had a curve (nothing is written otherwise).
    """
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = 0
    for m in METHODS:
        curves = [c for c in (selection_curve(r) for r in (runs.get(m) or {}).values()) if c is not None]
        for k, c in enumerate(curves):
            colour = colours[drawn % len(colours)]
            label = LABELS[m] if k == 0 else None
            top.plot(c["curve_rounds"], c["val_loss"], color=colour, lw=0.9, label=label)
            bottom.plot(c["curve_rounds"], c["val_auroc"], color=colour, lw=0.9)
            if c["best_round"] in c["curve_rounds"]:
                i = c["curve_rounds"].index(c["best_round"])
                bottom.plot(c["best_round"], c["val_auroc"][i], "o", color=colour, ms=4)
        drawn += bool(curves)
    if not drawn:
        plt.close(fig)
        return False
    top.set_ylabel("validation loss (the selection rule)")
    bottom.set_ylabel("CC sites' mean validation AUROC")
    bottom.set_xlabel("round (FedFew: stage-2 round, warm-up then energy)")
    bottom.axhline(0.5, color="grey", lw=0.8, ls=":")
    top.legend(fontsize=7, ncol=2)
    top.set_title("FedFew benchmark: learning curves, one line per seed (dots: the kept round)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(result: dict[str, Any], out: Path) -> list[str]:
    """``uc_f1.png`` (F1 of each UC and the mean, per method), ``cc_auroc.png`` (mean CC AUROC per
    method), ``ssl_probe.png`` (stage 1's probe AUROC per round budget) and ``learning_curves.png``
    (validation loss and CC AUROC per round of the runs that recorded them).

    Args:
        result: the benchmark's results (with a summary).
        out: the output folder.

    Returns:
        The file names written.
    """
    table = result.get("summary", {}).get("methods", {})
    methods = [m for m in METHODS if m in table]
    if not methods:
        return []
    _uc_f1(table, methods, out / "uc_f1.png")
    names = ["uc_f1.png"]
    with_cc = [m for m in methods if table[m]["mean_cc_auroc"]["mean"] is not None]
    if with_cc:
        _cc_auroc(table, with_cc, out / "cc_auroc.png")
        names.append("cc_auroc.png")
    probe = (table.get("fedfew") or {}).get("ssl_probe")
    if probe:
        _probe(probe, out / "ssl_probe.png")
        names.append("ssl_probe.png")
    if _learning_curves(result.get("runs") or {}, out / "learning_curves.png"):
        names.append("learning_curves.png")
    return names
