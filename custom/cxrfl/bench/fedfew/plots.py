"""The FedFew benchmark's plots: UC F1 and CC AUROC per method, stage 1's probe AUROC per round budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cxrfl.bench.fedfew.settings import METHODS
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


def write_plots(result: dict[str, Any], out: Path) -> list[str]:
    """``uc_f1.png`` (F1 of each UC and the mean, per method), ``cc_auroc.png`` (mean CC AUROC per
    method) and ``ssl_probe.png`` (stage 1's probe AUROC per round budget).

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
    return names
