"""Benchmark of cyclical weight transfer on the real NIH images: the paper's splits 1-10.

``cxrfl bench compare --method cwt`` (or ``cxrfl bench-cwt``, ``benchmarks/cwt_splits.py``)
runs :func:`run_cwt_benchmark`. The paper's task (abnormal = any finding vs ``No Finding``) on
the 1,000 real NIH images of ``../shared/data/nih1000`` (about half ``No Finding``):

1. every patient keeps at most ``max_patient_images`` images (abnormal ones first: the scarce
   label); patients (never images) are drawn into a balanced held-out test set, a balanced
   validation set and a balanced training set of ``per_class`` abnormal + ``per_class`` normal
   images — the paper's 3,200 + 3,200, scaled down;
2. the training set is partitioned by patient into 4 sites with exactly the paper's per-site
   counts, scaled: Table 1 (splits 1-5: sample-size variability) and Table 3 (splits 6-10:
   label-distribution variability). Every split uses the same training images, so central
   hosting (one site holding all of them) is one run per seed;
3. per seed: central hosting; vanilla CWT, CWT+PLTI and CWT+CLR on splits 1-5; vanilla CWT,
   CWT+LWMS and CWT+CWL on splits 6-10 (fixed order 1 > 2 > 3 > 4, as in the paper). A run whose
   settings reduce exactly to another one's (PLTI and CLR with equal site sizes, CWL with
   balanced sites, split 6 = split 1) is not trained again but reported as that run;
4. accuracy (threshold 0.5) and AUROC of the best-validation-loss model on the test set,
   mean +- SD over seeds, the percent of central accuracy (as the paper reports gaps), the
   paired differences behind the issue's targets, a JSON file and a plot like the paper's
   Figures 3-4.

The training engine is :func:`cxrfl.cwt.run_cwt` (plain PyTorch, the same site code the NVFlare
executor runs).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from cxrfl.cwt.config import BINARY_CLASS, CWTConfig
from cxrfl.cwt.inprocess import run_cwt
from cxrfl.cwt.relay import relay_plan
from cxrfl.cwt.site import binary_labels, CWTSite, eval_summary
from cxrfl.data.site import SiteData, load_site
from cxrfl.errors import DataError
from cxrfl.nn.models import ModelConfig

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SITE_CONFIG = REPO / "site_configs" / "nih1000.yaml"

TABLE_1: dict[int, list[tuple[int, int]]] = {
    1: [(800, 800), (800, 800), (800, 800), (800, 800)],
    2: [(960, 960), (853, 853), (747, 747), (640, 640)],
    3: [(1120, 1120), (907, 907), (693, 693), (480, 480)],
    4: [(1280, 1280), (960, 960), (640, 640), (320, 320)],
    5: [(1440, 1440), (1013, 1013), (587, 587), (160, 160)],
}
"""The paper's Table 1: (abnormal, normal) training images per institution, splits 1-5."""

TABLE_3: dict[int, list[tuple[int, int]]] = {
    6: [(800, 800), (800, 800), (800, 800), (800, 800)],
    7: [(960, 640), (853, 747), (747, 853), (640, 960)],
    8: [(1120, 480), (907, 693), (693, 907), (480, 1120)],
    9: [(1280, 320), (960, 640), (640, 960), (320, 1280)],
    10: [(1440, 160), (1013, 587), (587, 1013), (160, 1440)],
}
"""The paper's Table 3: (abnormal, normal) training images per institution, splits 6-10."""

PAPER_SPLITS = {**TABLE_1, **TABLE_3}
PAPER_PER_CLASS = 3200
SITES = ("inst-1", "inst-2", "inst-3", "inst-4")
CENTRAL = "Central hosting"
METHODS: dict[str, dict[str, bool]] = {
    "CWT": {},
    "CWT+PLTI": {"plti": True},
    "CWT+CLR": {"clr": True},
    "CWT+LWMS": {"lwms": True},
    "CWT+CWL": {"cwl": True},
}
SPLIT_METHODS = {**{s: ("CWT", "CWT+PLTI", "CWT+CLR") for s in TABLE_1}, **{s: ("CWT", "CWT+LWMS", "CWT+CWL") for s in TABLE_3}}


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
    augment: bool = True
    threads: int = 1
    data_seed: int = 0
    splits: tuple[int, ...] = tuple(range(1, 11))

    def cwt_config(self, seed: int, **flags: bool) -> CWTConfig:
        return CWTConfig(task="binary", num_cycles=self.cycles, order="fixed", lr=self.lr, batch_size=self.batch_size,
                         patience=self.patience, augment=self.augment, seed=seed, **flags)


# ------------------------------------------------------------------------ data
def scale_split(rows: Sequence[tuple[int, int]], per_class: int) -> list[tuple[int, int]]:
    """The paper's per-institution counts scaled to ``per_class`` images per label (sums kept exact).

    Largest-remainder rounding per label column, so each column sums to ``per_class``.

    Args:
        rows: (abnormal, normal) per institution, each column summing to 3,200.
        per_class: the scaled column sum.
    """
    out = []
    cols = []
    for j in range(2):
        raw = np.array([r[j] for r in rows], dtype=np.float64) * per_class / PAPER_PER_CLASS
        base = np.floor(raw).astype(int)
        for i in np.argsort(-(raw - base), kind="stable")[: per_class - base.sum()]:
            base[i] += 1
        cols.append(base)
    for i in range(len(rows)):
        out.append((int(cols[0][i]), int(cols[1][i])))
    return out


def load_pool(site_config: str | Path = DEFAULT_SITE_CONFIG, max_patient_images: int = 10, seed: int = 0) -> pd.DataFrame:
    """The real NIH images with the binary label, at most ``max_patient_images`` per patient.

    Args:
        site_config: the nih1000 site config.
        max_patient_images: cap per patient (abnormal images kept first, then normal, at random).
        seed: seed of which images of a large patient are kept.
    """
    data = load_site(site_config, check_images=False)
    table = data.table[["path", "patient"]].copy()
    table["y"] = binary_labels(data.table, data.classes).to_numpy()
    table = table[table["y"].notna()].reset_index(drop=True)
    rng = np.random.default_rng(seed)
    table["_r"] = rng.random(len(table))
    table = table.sort_values(["patient", "y", "_r"], ascending=[True, False, True])
    table = table.groupby("patient", sort=False).head(max_patient_images).drop(columns="_r").reset_index(drop=True)
    return table


def _patients(table: pd.DataFrame) -> pd.DataFrame:
    g = table.groupby("patient")["y"].agg(["size", "sum"])
    return pd.DataFrame({"patient": g.index, "a": g["sum"].astype(int).to_numpy(),
                         "b": (g["size"] - g["sum"]).astype(int).to_numpy()})


def pick_patients(patients: pd.DataFrame, a: int, b: int, rng: np.random.Generator, tries: int = 500) -> list[str]:
    """Whole patients whose images sum to exactly ``a`` abnormal and ``b`` normal images.

    Args:
        patients: ``patient``, ``a`` (abnormal images), ``b`` (normal images).
        a: abnormal images wanted.
        b: normal images wanted.
        rng: random generator (random greedy passes until one is exact).
        tries: greedy passes before giving up.

    Raises:
        DataError: no exact selection was found.
    """
    pa, pb, names = patients["a"].to_numpy(), patients["b"].to_numpy(), patients["patient"].to_numpy()
    best = None
    for _ in range(tries):
        order = rng.permutation(len(names))
        ra, rb, chosen = a, b, []
        for i in order:
            if pa[i] <= ra and pb[i] <= rb:
                chosen.append(names[i])
                ra, rb = ra - pa[i], rb - pb[i]
                if ra == 0 and rb == 0:
                    return chosen
        if best is None or ra + rb < best[0]:
            best = (ra + rb, ra, rb)
    raise DataError(f"cannot draw whole patients with exactly {a} abnormal + {b} normal images "
                    f"(closest: {a - best[1]} + {b - best[2]}); lower per_class or the test/val sizes")


def partition(patients: pd.DataFrame, quotas: Sequence[tuple[int, int]], rng: np.random.Generator, tries: int = 2000) -> dict[str, int]:
    """Assign whole patients to sites so that site i gets exactly ``quotas[i]`` (abnormal, normal) images.

    Random greedy passes, largest patients first: each patient goes to a site it fits in, chosen
    with probability proportional to the room left there.

    Args:
        patients: ``patient``, ``a``, ``b``; their sums equal the quotas' sums.
        quotas: (abnormal, normal) per site.
        rng: random generator.
        tries: passes before giving up.

    Raises:
        DataError: no exact partition found.
    """
    pa, pb, names = patients["a"].to_numpy(), patients["b"].to_numpy(), patients["patient"].to_numpy()
    q = np.array(quotas, dtype=np.int64)
    if pa.sum() != q[:, 0].sum() or pb.sum() != q[:, 1].sum():
        raise ValueError(f"patients hold {pa.sum()}+{pb.sum()} images, the quotas sum to {q[:, 0].sum()}+{q[:, 1].sum()}")
    size = pa + pb
    for _ in range(tries):
        jitter = rng.random(len(names))
        order = np.lexsort((jitter, -size))
        room = q.copy()
        choice: dict[str, int] = {}
        for i in order:
            fits = np.flatnonzero((room[:, 0] >= pa[i]) & (room[:, 1] >= pb[i]))
            if not len(fits):
                break
            weight = (room[fits, 0] - pa[i] + room[fits, 1] - pb[i] + 1).astype(np.float64)
            site = int(rng.choice(fits, p=weight / weight.sum()))
            room[site] -= (pa[i], pb[i])
            choice[names[i]] = site
        else:
            return choice
    raise DataError(f"no exact patient partition into {quotas} found in {tries} passes")


@dataclass
class BenchData:
    """The benchmark's images: held-out test, validation and training sets, and per-split sites."""

    test: pd.DataFrame
    val: pd.DataFrame
    train: pd.DataFrame
    splits: dict[int, list[tuple[int, int]]]
    assignment: dict[int, dict[str, int]]

    def sites(self, split: int) -> list[SiteData]:
        """The 4 institutions of one split (validation images spread over them by patient)."""
        out = []
        val_patients = sorted(self.val["patient"].unique())
        for i, name in enumerate(SITES):
            train = self.train[self.train["patient"].map(self.assignment[split]) == i]
            val = self.val[self.val["patient"].isin(val_patients[i:: len(SITES)])]
            out.append(_site_data(name, train, val))
        return out

    def central(self) -> SiteData:
        return _site_data("central", self.train, self.val)

    def test_site(self) -> SiteData:
        return SiteData(site="test", classes=[BINARY_CLASS], table=_frame(self.test, "test"))


def _frame(table: pd.DataFrame, split: str) -> pd.DataFrame:
    return pd.DataFrame({"path": table["path"].to_numpy(), "patient": table["patient"].to_numpy(), "split": split,
                         BINARY_CLASS: table["y"].to_numpy(dtype=np.float64)})


def _site_data(name: str, train: pd.DataFrame, val: pd.DataFrame) -> SiteData:
    """A site whose only finding column is the binary label (so the binary task keeps it as is)."""
    table = pd.concat([_frame(train, "train"), _frame(val, "val")], ignore_index=True)
    return SiteData(site=name, classes=[BINARY_CLASS], table=table)


def prepare_data(settings: BenchSettings, site_config: str | Path = DEFAULT_SITE_CONFIG) -> BenchData:
    """Draw the test, validation and training sets by patient and partition the training set per split.

    Args:
        settings: sizes and the data seed.
        site_config: the nih1000 site config.
    """
    pool = load_pool(site_config, settings.max_patient_images, settings.data_seed)
    rng = np.random.default_rng(settings.data_seed)
    left = _patients(pool)
    chosen = {}
    for name, n in (("test", settings.test_per_class), ("val", settings.val_per_class), ("train", settings.per_class)):
        picked = pick_patients(left, n, n, rng)
        chosen[name] = pool[pool["patient"].isin(picked)].reset_index(drop=True)
        left = left[~left["patient"].isin(picked)]
    train_patients = _patients(chosen["train"])
    splits, assignment, by_quota = {}, {}, {}
    for split in settings.splits:
        quotas = scale_split(PAPER_SPLITS[split], settings.per_class)
        splits[split] = quotas
        key = tuple(quotas)
        if key not in by_quota:  # the same counts (splits 1 and 6) get the same partition
            seed = [settings.data_seed, *[x for q in quotas for x in q]]
            by_quota[key] = partition(train_patients, quotas, np.random.default_rng(seed))
        assignment[split] = by_quota[key]
    return BenchData(test=chosen["test"], val=chosen["val"], train=chosen["train"], splits=splits, assignment=assignment)


# ----------------------------------------------------------------------- runs
def _signature(split_key: Any, sites: Sequence[CWTSite], config: CWTConfig) -> tuple:
    """What a run computes: runs with equal signatures are bit-for-bit the same run."""
    plan = relay_plan({s.name: s.num_train for s in sites}, config)
    weights = [w for s in sites for w in s.loss_weights if w is not None]
    # every weight exactly 1 (or CWL off): the plain loss
    cwl = None if all(bool((w == 1.0).all()) for w in weights) else tuple(tuple(w.tolist()) for w in weights)
    return (split_key, tuple((s, v.steps, round(v.lr, 15)) for s, v in plan.items()), config.lwms, cwl, config.seed)


def _evaluate(result, test: CWTSite) -> dict[str, Any]:
    summary = eval_summary(test.evaluate(result.model, "test"))
    return {"accuracy": summary["accuracy"], "auroc": summary["mean_auroc"], "test_loss": summary["loss"],
            "n_test": summary["n"], "best_cycle": result.best_cycle, "best_val_loss": result.best_val_loss,
            "cycles_run": len(result.history) - 1, "seconds": round(result.seconds, 1),
            "plan": {s: {"steps": v.steps, "lr": v.lr} for s, v in result.plan.items()}}


def _mean_sd(values: Sequence[float]) -> dict[str, Any]:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return {"mean": float(np.mean(v)) if v else None, "sd": float(np.std(v, ddof=1)) if len(v) > 1 else None, "n": len(v)}


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
    colors = {CENTRAL: "black", "CWT": "tab:red", "CWT+PLTI": "tab:blue", "CWT+CLR": "tab:green",
              "CWT+LWMS": "tab:purple", "CWT+CWL": "tab:orange"}
    for col, (title, splits) in enumerate(groups):
        if not splits:
            continue
        methods = SPLIT_METHODS[splits[0]]
        for row, metric in enumerate(("accuracy", "auroc")):
            ax = axes[row][col]
            c = summary["central"][metric]
            if c["mean"] is not None:
                ax.axhline(c["mean"], color=colors[CENTRAL], lw=1.2, label=f"{CENTRAL} (same images)")
                if c["sd"]:
                    ax.axhspan(c["mean"] - c["sd"], c["mean"] + c["sd"], color="grey", alpha=0.15)
            for k, m in enumerate(methods):
                ys = [summary["splits"][str(s)][m][metric] for s in splits]
                x = np.arange(len(splits)) + (k - 1) * 0.12
                ax.errorbar(x, [y["mean"] for y in ys], yerr=[y["sd"] or 0 for y in ys], fmt="o-", capsize=3,
                            color=colors[m], label=m)
            ax.set_xticks(np.arange(len(splits)), [str(s) for s in splits])
            ax.set_xlabel("split")
            ax.set_ylabel(f"test {'accuracy' if metric == 'accuracy' else 'AUROC'}")
            if row == 0:
                ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower left")
    fig.suptitle("Cyclical weight transfer on 1,000 real NIH images (abnormal vs No Finding), mean +- SD over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _machine() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "load_average_at_start": load}


def run_cwt_benchmark(
    out: str | Path = REPO / "benchmarks" / "results",
    seeds: int = 3,
    *,
    settings: BenchSettings | None = None,
    site_config: str | Path = DEFAULT_SITE_CONFIG,
    log: Callable[[str], None] = print,
    resume: bool = True,
) -> dict[str, Any]:
    """Run the CWT benchmark and write ``OUT/cwt.json`` and ``OUT/cwt.png``.

    Args:
        out: output folder.
        seeds: training seeds (overrides ``settings.seeds``).
        settings: everything else (default: :class:`BenchSettings`).
        site_config: the nih1000 site config (real NIH images).
        log: progress lines.
        resume: reuse the finished runs of an earlier call with the same settings in ``OUT/cwt.json``.

    Returns:
        The written results.
    """
    settings = settings or BenchSettings()
    settings = BenchSettings(**{**asdict(settings), "seeds": seeds})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "cwt.json"
    torch.set_num_threads(settings.threads)
    start, cpu_start = time.perf_counter(), time.process_time()
    data = prepare_data(settings, site_config)
    log(f"data: test {len(data.test)}, val {len(data.val)}, train {len(data.train)} images "
        f"({data.train['patient'].nunique()} patients); splits {data.splits}")
    model_config = ModelConfig(image_size=settings.image_size)
    settings_dict = {**asdict(settings), "splits": list(settings.splits)}
    runs: list[dict[str, Any]] = []
    if resume and json_path.is_file():
        old = json.loads(json_path.read_text())
        if old.get("settings") == settings_dict:
            runs = [r for r in old.get("runs", []) if not r.get("same_as")]
            log(f"resuming: {len(runs)} finished run(s) in {json_path}")
    done = {(r["seed"], r["split"], r["method"]): r for r in runs}
    base = settings.cwt_config(0)
    test = CWTSite(data.test_site(), base, model_config)
    split_sites = {split: [CWTSite(d, base, model_config) for d in data.sites(split)] for split in settings.splits}
    central = [CWTSite(data.central(), base, model_config)]

    def write(final: bool = False) -> dict[str, Any]:
        result = {
            "settings": settings_dict, "machine": _machine(),
            "command": f"cxrfl bench compare --method cwt --profile cwt-splits --seeds {settings.seeds} --out {out}",
            "data": {"source": str(site_config), "test_images": len(data.test), "val_images": len(data.val),
                     "train_images": len(data.train), "train_patients": int(data.train["patient"].nunique()),
                     "splits": {str(k): v for k, v in data.splits.items()}},
            "runs": runs, "seconds": round(time.perf_counter() - start, 1),
            "cpu_seconds": round(time.process_time() - cpu_start, 1), "complete": final,
        }
        if final:
            result["summary"] = summarise(runs, settings)
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(json_path)
        return result

    for seed in range(settings.seeds):
        key = (seed, 0, CENTRAL)
        if key not in done:
            cfg = settings.cwt_config(seed)
            central[0].configure(cfg)
            r = {"seed": seed, "split": 0, "method": CENTRAL, **_evaluate(run_cwt(central, model_config, cfg), test)}
            runs.append(r)
            done[key] = r
            write()
        log(f"seed {seed} {CENTRAL}: accuracy {done[key]['accuracy']:.3f} AUROC {done[key]['auroc']:.3f} ({done[key]['seconds']}s)")
        seen: dict[tuple, dict[str, Any]] = {}
        for split in settings.splits:
            sites = split_sites[split]
            for method in SPLIT_METHODS[split]:
                cfg = settings.cwt_config(seed, **METHODS[method])
                for s in sites:
                    s.configure(cfg)
                sig = _signature(tuple(data.splits[split]), sites, cfg)
                key = (seed, split, method)
                if key in done:
                    r = done[key]
                elif sig in seen:
                    src = seen[sig]
                    r = {**src, "split": split, "method": method, "same_as": f"split {src['split']} {src['method']}"}
                    runs.append(r)
                else:
                    r = {"seed": seed, "split": split, "method": method, **_evaluate(run_cwt(sites, model_config, cfg), test)}
                    runs.append(r)
                    done[key] = r
                    write()
                if not r.get("same_as"):
                    seen.setdefault(sig, r)
                note = f" (= {r['same_as']})" if r.get("same_as") else f" ({r['seconds']}s, best cycle {r['best_cycle']})"
                log(f"seed {seed} split {split} {method}: accuracy {r['accuracy']:.3f} AUROC {r['auroc']:.3f}{note}")
    result = write(final=True)
    plot(result["summary"], out / "cwt.png")
    log(f"wrote {json_path} and {out / 'cwt.png'} in {result['seconds']:.0f}s")
    return result


def markdown_tables(summary: dict[str, Any]) -> str:
    """The result tables in Markdown: test accuracy and AUROC (mean +- SD) and percent of central accuracy.

    Args:
        summary: output of :func:`summarise` (``cwt.json``'s ``summary``).
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


def mechanism_table(settings: BenchSettings | None = None) -> str:
    """What each optimization changes at splits 5 and 10, computed from the counts (no training).

    Split 5: draws per training image per cycle (steps x batch / n_i) under vanilla CWT and PLTI,
    and CLR's rates. Split 10: the abnormal share of a minibatch (vanilla: the local share; LWMS:
    one half) and CWL's weights of the abnormal / normal terms.

    Args:
        settings: sizes and batch (default :class:`BenchSettings`).
    """
    from cxrfl.cwt.optimizations import cwl_class_weights

    settings = settings or BenchSettings()
    b = settings.batch_size
    q5 = scale_split(TABLE_1[5], settings.per_class)
    counts = {s: a + n for s, (a, n) in zip(SITES, q5)}
    van = relay_plan(counts, settings.cwt_config(0))
    plti = relay_plan(counts, settings.cwt_config(0, plti=True))
    clr = relay_plan(counts, settings.cwt_config(0, clr=True))
    lines = ["| split 5 | " + " | ".join(SITES) + " |", "|" + " --- |" * (len(SITES) + 1),
             "| training images | " + " | ".join(str(counts[s]) for s in SITES) + " |",
             "| vanilla: steps, draws per image per cycle | "
             + " | ".join(f"{van[s].steps}, {van[s].steps * b / counts[s]:.2f}" for s in SITES) + " |",
             "| PLTI: steps, draws per image per cycle | "
             + " | ".join(f"{plti[s].steps}, {plti[s].steps * b / counts[s]:.2f}" for s in SITES) + " |",
             "| CLR: learning rate (x 1e-3) | " + " | ".join(f"{1e3 * clr[s].lr:.2f}" for s in SITES) + " |", ""]
    q10 = scale_split(TABLE_3[10], settings.per_class)
    lines += ["| split 10 | " + " | ".join(SITES) + " |", "|" + " --- |" * (len(SITES) + 1),
              "| abnormal / normal images | " + " | ".join(f"{a} / {n}" for a, n in q10) + " |",
              "| abnormal share of a minibatch: vanilla, LWMS | "
              + " | ".join(f"{a / (a + n):.2f}, 0.50" for a, n in q10) + " |",
              "| CWL weight of abnormal / normal terms | "
              + " | ".join("{:.2f} / {:.2f}".format(*(float(w[0]) for w in cwl_class_weights([a], [a + n]))) for a, n in q10) + " |"]
    return "\n".join(lines)
