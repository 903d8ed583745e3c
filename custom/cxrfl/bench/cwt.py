"""Benchmark of cyclical weight transfer on the real NIH images: the paper's splits 1-10.

``cxrfl bench cwt`` (``benchmarks/cwt_splits.py``) runs :func:`run_cwt_benchmark`. The paper's
task (abnormal = any finding vs ``No Finding``) on the real NIH images of
``../shared/data/nih1000``, drawn by patient into a test set, a validation set and one training
set that every split partitions into 4 institutions with the paper's Table 1 / Table 3 counts,
scaled (:mod:`cxrfl.bench.cwt_data`). Per seed: central hosting; vanilla CWT, CWT+PLTI and
CWT+CLR on splits 1-5; vanilla CWT, CWT+LWMS and CWT+CWL on splits 6-10 (fixed order
1 > 2 > 3 > 4, as in the paper). A run whose settings reduce exactly to another one's (PLTI and
CLR with equal site sizes, CWL with balanced sites, split 6 = split 1) is not trained again but
reported as that run. Every run uses the paper's base recipe (Adam, learning rate decayed by
``lr_decay`` every ``lr_decay_every`` iterations across visits, L2 ``weight_decay``).

The training engine is :func:`cxrfl.cwt.inprocess.run_cwt`: the relay server of the NVFlare job
with the sites called in this process; central hosting is the relay over one site holding all
the training images. Accuracy (threshold 0.5) and AUROC of the best-validation-loss model on the
test set, mean +- SD over seeds, the percent of central accuracy (as the paper reports gaps)
and the paired differences behind the issue's targets.

Written to ``--out``: ``runs/<method>__split<k>__seed<s>.json`` as each run finishes (a stopped
benchmark goes on from there), ``results.json`` (per method and split: ``accuracy_mean``,
``auroc_mean``, their SDs and the values per seed; the summary and every run), ``report.md``,
``cwt.png`` (accuracy and AUROC per split, like the paper's Figures 3-4) and ``cwt_curves.png``
(pooled validation loss per cycle).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.bench.cwt_data import DEFAULT_SITE_CONFIG, REPO, TABLE_1, TABLE_3, BenchData, prepare_data
from cxrfl.common.io import write_json
from cxrfl.cwt.config import CWTConfig
from cxrfl.cwt.inprocess import CWTResult, run_cwt
from cxrfl.cwt.relay import relay_plan
from cxrfl.cwt.site import CWTSite, eval_summary
from cxrfl.nn.models import ModelConfig

logger = logging.getLogger(__name__)

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
SPLIT_METHODS = {**{s: ("CWT", "CWT+PLTI", "CWT+CLR") for s in TABLE_1}, **{s: ("CWT", "CWT+LWMS", "CWT+CWL") for s in TABLE_3}}
COLORS = {CENTRAL: "black", "CWT": "tab:red", "CWT+PLTI": "tab:blue", "CWT+CLR": "tab:green",
          "CWT+LWMS": "tab:purple", "CWT+CWL": "tab:orange"}


@dataclass(frozen=True)
class BenchSettings:
    """What the benchmark trains (defaults sized for a shared 2-core CPU, about 30 minutes).

    Args:
        seeds: training seeds (model initialisation, sampling, augmentation).
        image_size: model input size (32: the smallest DenseNet121 input; 64: the images' size).
        per_class: abnormal (= normal) training images over all sites (the paper: 3,200).
        test_per_class: abnormal (= normal) held-out test images.
        val_per_class: abnormal (= normal) validation images (early stopping, best cycle).
        max_patient_images: at most this many images per patient (abnormal ones kept first).
        cycles: most cycles (= epochs over all training images; one cycle is one epoch).
        patience: cycles without validation-loss improvement before stopping.
        batch_size: minibatch size.
        lr: the global Adam learning rate.
        lr_decay: the rate's decay factor (the paper: 0.99).
        lr_decay_every: iterations between two decays; None: one epoch over the training set
            (the paper's 200 iterations were one epoch of its 6,400 images at batch 32).
        weight_decay: the L2 coefficient (the paper: 1e-4).
        augment: random rotation/flip/zoom/contrast.
        threads: torch CPU threads (1 is fastest on a machine shared with other jobs).
        data_seed: seed of the test/validation/training draw and of the site partitions.
        splits: which of the paper's splits 1-10 to run.
    """

    seeds: int = 3
    image_size: int = 32
    per_class: int = 200
    test_per_class: int = 90
    val_per_class: int = 40
    max_patient_images: int = 10
    cycles: int = 3
    patience: int = 2
    batch_size: int = 32
    lr: float = 1e-3
    lr_decay: float = 0.99
    lr_decay_every: int | None = None
    weight_decay: float = 1e-4
    augment: bool = True
    threads: int = 1
    data_seed: int = 0
    splits: tuple[int, ...] = tuple(range(1, 11))

    def cwt_config(self, seed: int, **flags: bool) -> CWTConfig:
        """The run's CWT settings.

        Args:
            seed: the training seed.
            flags: the optimizations switched on (``plti=True`` ...).
        """
        every = self.lr_decay_every or max(1, round(2 * self.per_class / self.batch_size))
        return CWTConfig(task="binary", num_cycles=self.cycles, order="fixed", lr=self.lr, lr_decay=self.lr_decay,
                         lr_decay_every=every, weight_decay=self.weight_decay, batch_size=self.batch_size,
                         patience=self.patience, augment=self.augment, seed=seed, **flags)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict."""
        return {**asdict(self), "splits": list(self.splits)}

    def run_key(self) -> dict[str, Any]:
        """The settings a kept run must share to be reused (not the number of seeds, nor the threads)."""
        return {k: v for k, v in self.to_dict().items() if k not in ("seeds", "threads")}


# ----------------------------------------------------------------------- runs
def _signature(split_key: Any, sites: Sequence[CWTSite], config: CWTConfig) -> tuple:
    """What a run computes: runs with equal signatures are bit-for-bit the same run."""
    plan = relay_plan({s.name: s.num_train for s in sites}, config)
    weights = [w for s in sites for w in s.loss_weights if w is not None]
    # every weight exactly 1 (or CWL off): the plain loss
    cwl = None if all(bool((w == 1.0).all()) for w in weights) else tuple(tuple(w.tolist()) for w in weights)
    return (split_key, tuple((s, v.steps, round(v.lr, 15)) for s, v in plan.items()), config.lwms, cwl, config.seed)


def _evaluate(result: CWTResult, test: CWTSite) -> dict[str, Any]:
    summary = eval_summary(test.evaluate(result.model, "test"))
    return {"accuracy": summary["accuracy"], "auroc": summary["mean_auroc"], "test_loss": summary["loss"],
            "n_test": summary["n"], "best_cycle": result.best_cycle, "best_val_loss": result.best_val_loss,
            "cycles_run": result.cycles_run, "stopped_early": result.stopped_early,
            "val_curve": [h["val_loss"] for h in result.history], "seconds": round(result.seconds, 1),
            "plan": {s: {"steps": v.steps, "lr": v.lr} for s, v in result.plan.items()}}


def _mean_sd(values: Sequence[float]) -> dict[str, Any]:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return {"mean": float(np.mean(v)) if v else None, "sd": float(np.std(v, ddof=1)) if len(v) > 1 else None, "n": len(v)}


def results_table(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per method and split (central hosting: split ``all``): accuracy and AUROC, mean, SD and per seed.

    Args:
        runs: one record per (seed, split, method), central runs with split 0.
    """
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for method in [CENTRAL, *METHODS]:
        for split in sorted({r["split"] for r in runs if r["method"] == method}):
            rs = sorted((r for r in runs if r["method"] == method and r["split"] == split), key=lambda r: r["seed"])
            acc, auc = _mean_sd([r["accuracy"] for r in rs]), _mean_sd([r["auroc"] for r in rs])
            table.setdefault(method, {})[CENTRAL_SPLIT if split == 0 else str(split)] = {
                "accuracy_mean": acc["mean"], "accuracy_sd": acc["sd"], "auroc_mean": auc["mean"], "auroc_sd": auc["sd"],
                "n_seeds": len(rs), "per_seed": {str(r["seed"]): {k: r.get(k) for k in (
                    "accuracy", "auroc", "best_cycle", "cycles_run", "same_as")} for r in rs}}
    return table


def summarise(runs: list[dict[str, Any]], settings: BenchSettings) -> dict[str, Any]:
    """Mean +- SD per split and method, percent of central accuracy, and the issue's targets.

    Args:
        runs: one record per (seed, split, method), central runs with split 0.
        settings: the settings (for the noise estimate).
    """
    central = [r for r in runs if r["method"] == CENTRAL]
    c_acc = _mean_sd([r["accuracy"] for r in central])
    c_auc = _mean_sd([r["auroc"] for r in central])
    table: dict[str, Any] = {"central": {"accuracy": c_acc, "auroc": c_auc}, "splits": {}}
    for split in settings.splits:
        row = {}
        for method in SPLIT_METHODS[split]:
            rs = [r for r in runs if r["split"] == split and r["method"] == method]
            acc, auc = _mean_sd([r["accuracy"] for r in rs]), _mean_sd([r["auroc"] for r in rs])
            pct = 100.0 * acc["mean"] / c_acc["mean"] if acc["mean"] is not None and c_acc["mean"] else None
            row[method] = {"accuracy": acc, "auroc": auc, "percent_of_central_accuracy": pct,
                           "reused": sorted({r["same_as"] for r in rs if r.get("same_as")})}
        table["splits"][str(split)] = row

    def paired(split: int, a: str, b: str, metric: str) -> dict[str, Any]:
        """b - a per seed (same seed: same partition, same initial weights)."""
        by = {(r["method"], r["seed"]): r[metric] for r in runs if r["split"] == split}
        cen = {r["seed"]: r[metric] for r in central}
        seeds = sorted({s for m, s in by if m == a} & {s for m, s in by if m == b})
        diffs = [by[(b, s)] - by[(a, s)] for s in seeds]
        gaps_a = [cen[s] - by[(a, s)] for s in seeds if s in cen]
        gaps_b = [cen[s] - by[(b, s)] for s in seeds if s in cen]
        p = None
        if len(diffs) > 1 and np.std(diffs) > 0:
            from scipy.stats import ttest_1samp

            p = float(ttest_1samp(diffs, 0.0).pvalue)  # paired t-test over seeds
        return {"diff": _mean_sd(diffs), "per_seed": diffs, "better_seeds": sum(d > 0 for d in diffs), "p_paired_t": p,
                "gap_to_central": {a: _mean_sd(gaps_a), b: _mean_sd(gaps_b)}}

    targets = {}
    if 5 in settings.splits:
        t = {m: paired(5, "CWT", "CWT+PLTI", m) for m in ("accuracy", "auroc")}
        ga, gb = t["accuracy"]["gap_to_central"]["CWT"]["mean"], t["accuracy"]["gap_to_central"]["CWT+PLTI"]["mean"]
        t["met"] = ga is not None and gb is not None and abs(gb) < abs(ga)
        t["target"] = "split 5: CWT+PLTI closer to central hosting (accuracy) than vanilla CWT"
        targets["split5_plti"] = t
    if 10 in settings.splits:
        for m in ("CWT+LWMS", "CWT+CWL"):
            t = {k: paired(10, "CWT", m, k) for k in ("accuracy", "auroc")}
            d = t["accuracy"]["diff"]["mean"]
            t["met"] = d is not None and d > 0
            t["target"] = f"split 10: {m} above vanilla CWT (accuracy)"
            targets[f"split10_{m.split('+')[1].lower()}"] = t
    n = 2 * settings.test_per_class
    acc = c_acc["mean"] or 0.5
    table["targets"] = targets
    table["noise"] = {"test_images": n, "binomial_sd_of_accuracy": math.sqrt(acc * (1 - acc) / n),
                      "seeds": settings.seeds}
    return table


def plot(summary: dict[str, Any], path: Path) -> None:
    """Test accuracy and AUROC per split, mean +- SD over seeds, like the paper's Figures 3-4.

    Args:
        summary: output of :func:`summarise`.
        path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row")
    groups = [("A: sample-size variability (Table 1)", [s for s in TABLE_1 if str(s) in summary["splits"]]),
              ("B: label-distribution variability (Table 3)", [s for s in TABLE_3 if str(s) in summary["splits"]])]
    for col, (title, splits) in enumerate(groups):
        if not splits:
            continue
        methods = SPLIT_METHODS[splits[0]]
        for row, metric in enumerate(("accuracy", "auroc")):
            ax = axes[row][col]
            c = summary["central"][metric]
            if c["mean"] is not None:
                ax.axhline(c["mean"], color=COLORS[CENTRAL], lw=1.2, label=f"{CENTRAL} (same images)")
                if c["sd"]:
                    ax.axhspan(c["mean"] - c["sd"], c["mean"] + c["sd"], color="grey", alpha=0.15)
            for k, m in enumerate(methods):
                ys = [summary["splits"][str(s)][m][metric] for s in splits]
                x = np.arange(len(splits)) + (k - 1) * 0.12
                ax.errorbar(x, [y["mean"] for y in ys], yerr=[y["sd"] or 0 for y in ys], fmt="o-", capsize=3,
                            color=COLORS[m], label=m)
            ax.set_xticks(np.arange(len(splits)), [str(s) for s in splits])
            ax.set_xlabel("split")
            ax.set_ylabel(f"test {'accuracy' if metric == 'accuracy' else 'AUROC'}")
            if row == 0:
                ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower left")
    fig.suptitle("Cyclical weight transfer on real NIH images (abnormal vs No Finding), mean +- SD over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(runs: Sequence[dict[str, Any]], splits: Sequence[int], path: Path) -> None:
    """Pooled validation loss per cycle (mean over seeds) of central hosting and each method at two splits.

    Args:
        runs: the run records (with ``val_curve``).
        splits: the splits to draw (the most unequal of each table by default: 5 and 10).
        path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean_curve(rs: list[dict[str, Any]]) -> list[float]:
        n = max((len(r.get("val_curve") or []) for r in rs), default=0)
        return [float(np.nanmean([r["val_curve"][i] for r in rs if len(r.get("val_curve") or []) > i])) for i in range(n)]

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


def result_tables(summary: dict[str, Any]) -> str:
    """The result tables in Markdown: test accuracy and AUROC (mean +- SD) and percent of central accuracy.

    Args:
        summary: output of :func:`summarise` (``results.json``'s ``summary``).
    """

    def f(x: dict[str, Any]) -> str:
        if x["mean"] is None:
            return "n/a"
        return f"{100 * x['mean']:.1f} +- {100 * x['sd']:.1f}" if x["sd"] is not None else f"{100 * x['mean']:.1f}"

    c = summary["central"]
    lines = []
    for title, table in (("Sample-size variability (Table 1 splits)", TABLE_1), ("Label-distribution variability (Table 3 splits)", TABLE_3)):
        splits = [s for s in table if str(s) in summary["splits"]]
        if not splits:
            continue
        methods = SPLIT_METHODS[splits[0]]
        lines += [f"**{title}** - test accuracy % / AUROC x 100, mean +- SD over seeds; (% of central accuracy)", "",
                  "| split | " + " | ".join([CENTRAL, *methods]) + " |", "|" + " --- |" * (len(methods) + 2)]
        for s in splits:
            row = summary["splits"][str(s)]
            cells = [f"{f(c['accuracy'])} / {f(c['auroc'])}"]
            for m in methods:
                r = row[m]
                pct = r["percent_of_central_accuracy"]
                same = f" [= {', '.join(r['reused'])}]" if r["reused"] else ""
                cells.append(f"{f(r['accuracy'])} / {f(r['auroc'])} ({pct:.1f}%){same}" if pct is not None else "n/a")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def report_markdown(result: dict[str, Any]) -> str:
    """``report.md``: what ran and where, the result tables, the targets with paired p-values, the plots.

    Args:
        result: the content of ``results.json``.
    """
    summary, data, machine = result["summary"], result["data"], result["machine"]
    lines = ["# Cyclical weight transfer: the paper's splits 1-10 on real NIH images", "",
             f"- Command: `{result['command']}`",
             f"- Machine: {machine['cpus']} CPUs, {machine['platform']}, torch {machine['torch']}, load average at start "
             f"{machine['load_average_at_start']}; wall time {result['seconds']:.0f} s",
             f"- Data: {data['source']}: test {data['test_images']}, validation {data['val_images']}, training "
             f"{data['train_images']} images ({data['train_patients']} patients), split counts {data['splits']}",
             f"- Settings: `{json.dumps(result['settings'])}`", "", result_tables(summary), "## Targets", ""]
    for t in summary["targets"].values():
        acc = t["accuracy"]
        p = f"{acc['p_paired_t']:.3g}" if acc["p_paired_t"] is not None else "n/a"
        diff = acc["diff"]["mean"]
        lines.append(f"- {t['target']}: **{'met' if t['met'] else 'not met'}** (mean paired accuracy difference "
                     f"{'n/a' if diff is None else f'{100 * diff:+.1f} points'}, paired t-test p = {p}; better in "
                     f"{acc['better_seeds']} of {len(acc['per_seed'])} seeds)")
    noise = summary["noise"]
    lines += ["", f"Noise: {noise['test_images']} test images give a binomial SD of about "
                  f"{100 * noise['binomial_sd_of_accuracy']:.1f} accuracy points per run; {noise['seeds']} seeds.", "",
              "![test accuracy and AUROC per split](cwt.png)", "", "![pooled validation loss per cycle](cwt_curves.png)", ""]
    return "\n".join(lines)


def _machine() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "load_average_at_start": load}


# ------------------------------------------------------------- saved runs
def run_file(folder: Path, method: str, split: int, seed: int) -> Path:
    """Where one finished run is kept (``runs/<method>__split<k>__seed<s>.json``).

    Args:
        folder: the ``runs`` folder.
        method: the method label.
        split: the split (0: central hosting).
        seed: the training seed.
    """
    return folder / f"{re.sub(r'[^A-Za-z0-9+]+', '_', method)}__split{split}__seed{seed}.json"


def load_runs(folder: Path, settings: dict[str, Any]) -> dict[tuple[int, int, str], dict[str, Any]]:
    """The finished runs kept under ``folder`` with these settings, by (seed, split, method).

    Args:
        folder: the ``runs`` folder.
        settings: :meth:`BenchSettings.run_key` of this benchmark.
    """
    done = {}
    for path in sorted(folder.glob("*.json")):
        try:
            saved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if saved.get("settings") == settings:
            r = saved["run"]
            done[(r["seed"], r["split"], r["method"])] = r
    return done


class _Runner:
    """Trains (or reuses) the runs of one benchmark, keeping each as soon as it is done."""

    def __init__(self, settings: BenchSettings, data: BenchData, out: Path, done: dict, log: Callable[[str], None]) -> None:
        self.settings, self.out, self.done, self.log = settings, out, done, log
        self.model_config = ModelConfig(image_size=settings.image_size)
        base = settings.cwt_config(0)
        self.test = CWTSite(data.test_site(), base, self.model_config)
        self.sites = {split: [CWTSite(d, base, self.model_config) for d in data.sites(split)] for split in settings.splits}
        self.sites[0] = [CWTSite(data.central(), base, self.model_config)]
        self.quotas = {0: None, **{s: tuple(data.splits[s]) for s in settings.splits}}
        self.runs: list[dict[str, Any]] = list(done.values())

    def seed(self, seed: int) -> None:
        """Central hosting and every split's methods for one seed."""
        seen: dict[tuple, dict[str, Any]] = {}
        for split, method in [(0, CENTRAL)] + [(s, m) for s in self.settings.splits for m in SPLIT_METHODS[s]]:
            cfg = self.settings.cwt_config(seed, **METHODS.get(method, {}))
            sites = self.sites[split]
            for s in sites:
                s.configure(cfg)
            sig = _signature(self.quotas[split], sites, cfg)
            r = self.done.get((seed, split, method))
            if r is None and sig in seen:
                src = seen[sig]
                r = {**src, "split": split, "method": method, "same_as": f"split {src['split']} {src['method']}"}
                self.runs.append(r)
            elif r is None:
                r = {"seed": seed, "split": split, "method": method, **_evaluate(run_cwt(sites, self.model_config, cfg), self.test)}
                self.keep(r)
            if not r.get("same_as"):
                seen.setdefault(sig, r)
            note = f" (= {r['same_as']})" if r.get("same_as") else f" ({r['seconds']}s, best cycle {r['best_cycle']})"
            where = CENTRAL if split == 0 else f"split {split} {method}"
            self.log(f"seed {seed} {where}: accuracy {r['accuracy']:.3f} AUROC {r['auroc']:.3f}{note}")

    def keep(self, run: dict[str, Any]) -> None:
        self.runs.append(run)
        self.done[(run["seed"], run["split"], run["method"])] = run
        write_json(run_file(self.out / "runs", run["method"], run["split"], run["seed"]),
                   {"settings": self.settings.run_key(), "run": run})


def run_cwt_benchmark(
    out: str | Path = REPO / "benchmarks" / "results" / "cwt",
    seeds: int = 3,
    *,
    settings: BenchSettings | None = None,
    site_config: str | Path = DEFAULT_SITE_CONFIG,
    log: Callable[[str], None] = logger.info,
    resume: bool = True,
) -> dict[str, Any]:
    """Run the CWT benchmark; write ``results.json``, ``report.md``, ``cwt.png``, ``cwt_curves.png`` to ``out``.

    Each finished (method, split, seed) run is kept in ``out/runs`` at once; a later call with the
    same settings reuses those runs and trains only the missing ones.

    Args:
        out: output folder.
        seeds: training seeds 0 .. seeds-1 (overrides ``settings.seeds``).
        settings: everything else (default: :class:`BenchSettings`).
        site_config: the nih1000 site config (real NIH images).
        log: progress lines.
        resume: reuse the finished runs kept in ``out/runs`` (False: train every run again).

    Returns:
        The content of ``results.json``.
    """
    settings = BenchSettings(**{**asdict(settings or BenchSettings()), "seeds": seeds})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(settings.threads)
    start, cpu_start = time.perf_counter(), time.process_time()
    data = prepare_data(per_class=settings.per_class, test_per_class=settings.test_per_class,
                        val_per_class=settings.val_per_class, max_patient_images=settings.max_patient_images,
                        data_seed=settings.data_seed, splits=settings.splits, site_config=site_config)
    log(f"data: test {len(data.test)}, val {len(data.val)}, train {len(data.train)} images "
        f"({data.train['patient'].nunique()} patients); splits {data.splits}")
    done = {k: r for k, r in load_runs(out / "runs", settings.run_key()).items() if k[0] < settings.seeds} if resume else {}
    if done:
        log(f"resuming: {len(done)} finished run(s) in {out / 'runs'}")
    runner = _Runner(settings, data, out, done, log)
    for seed in range(settings.seeds):
        runner.seed(seed)
    result = {
        "settings": settings.to_dict(), "machine": _machine(),
        "command": f"cxrfl bench cwt --seeds {settings.seeds} --out {out}",
        "data": {"source": str(site_config), "test_images": len(data.test), "val_images": len(data.val),
                 "train_images": len(data.train), "train_patients": int(data.train["patient"].nunique()),
                 "splits": {str(k): v for k, v in data.splits.items()}},
        "results": results_table(runner.runs), "summary": summarise(runner.runs, settings), "runs": runner.runs,
        "seconds": round(time.perf_counter() - start, 1), "cpu_seconds": round(time.process_time() - cpu_start, 1),
    }
    write_json(out / "results.json", result)
    plot(result["summary"], out / "cwt.png")
    plot_curves(runner.runs, [s for s in (5, 10) if s in settings.splits] or list(settings.splits[:1]), out / "cwt_curves.png")
    (out / "report.md").write_text(report_markdown(result))
    log(f"wrote {out / 'results.json'}, {out / 'report.md'} and the plots in {result['seconds']:.0f}s")
    return result
