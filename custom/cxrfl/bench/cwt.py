"""Benchmark of cyclical weight transfer: the paper's splits 1-10 on the real NIH images and on a
larger synthetic cohort.

``cxrfl bench cwt`` (``benchmarks/cwt_splits.py``) runs :func:`run_cwt_benchmark`. The paper's
task (abnormal = any finding vs no finding), on two pools of images (:mod:`cxrfl.bench.cwt_data`):

- ``nih1000``: every usable real NIH image of ``../shared/data/nih1000`` (at most
  ``max_patient_images`` per patient, balanced), drawn by patient into a test set, a validation
  set and one training set that every split partitions into 4 institutions with the paper's
  Table 1 / Table 3 counts, scaled;
- ``synthetic``: the same splits drawn from a synthetic NIH-like cohort of ``synthetic_images``
  images (:mod:`cxrfl.synth`), with a larger test set: 1,000 real images give little power.

Per dataset and seed: central hosting; vanilla CWT, CWT+PLTI and CWT+CLR on splits 1-5; vanilla
CWT, CWT+LWMS and CWT+CWL on splits 6-10 (fixed order 1 > 2 > 3 > 4, as in the paper). A run whose
settings reduce exactly to another one's (PLTI and CLR with equal site sizes, CWL with balanced
sites, split 6 = split 1) is not trained again but reported as that run. Every run uses the
paper's base recipe (Adam, learning rate decayed by ``lr_decay`` every ``lr_decay_every``
iterations across visits, L2 ``weight_decay``) and stops after ``patience`` cycles without a
lower pooled validation loss (at most ``cycles``), keeping its best cycle.

The training engine is :func:`cxrfl.cwt.inprocess.run_cwt`: the relay server of the NVFlare job
with the sites called in this process; central hosting is the relay over one site holding all
the training images. Seeds run in ``jobs`` parallel processes. Summary, targets and plots:
:mod:`cxrfl.bench.cwt_report`.

Written to ``--out``: ``runs/<dataset>/<method>__split<k>__seed<s>.json`` as each run finishes (a
stopped benchmark goes on from there), ``results.json`` (``results[dataset][method][split]``:
``accuracy_mean``, ``auroc_mean``, their SDs and the values per seed; per dataset the data, the
summary with the targets; every run, with the commit and machine that trained it; ``provenance``:
those per commit and machine and the summed run time), ``report.md``, and per dataset
``cwt_<dataset>.png`` (accuracy and AUROC per split, like the paper's Figures 3-4) and
``cwt_curves_<dataset>.png`` (pooled validation loss per cycle).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from cxrfl.bench.arch import with_arch
from cxrfl.bench.cwt_data import DEFAULT_SITE_CONFIG, REPO, CWTBenchData, prepare_data, synthetic_site_config
from cxrfl.bench.cwt_report import (
    CENTRAL,
    DATASET_TITLES,
    METHODS,
    SPLIT_METHODS,
    plot,
    plot_curves,
    provenance,
    report_markdown,
    results_table,
    summarise,
)
from cxrfl.bench.protocol import code_version, command_line, machine
from cxrfl.common.config import Config
from cxrfl.common.io import write_json
from cxrfl.cwt.config import CWTConfig
from cxrfl.cwt.inprocess import CWTResult, run_cwt
from cxrfl.cwt.relay import relay_plan
from cxrfl.cwt.site import CWTSite, eval_summary
from cxrfl.nn.models import ARCHS, ModelConfig

logger = logging.getLogger(__name__)

DATASETS = ("nih1000", "synthetic")


@dataclass(frozen=True)
class CWTBenchSettings(Config):
    """What the benchmark trains.

    Args:
        seeds: training seeds (model initialisation, sampling, augmentation); at least 5 for the paired tests.
        image_size: model input size (64: the real images' size).
        arch: the network (:mod:`cxrfl.bench.arch`).
        per_class: abnormal (= normal) training images of the real pool over all sites (None:
            every usable image left after the test and validation sets).
        test_per_class: abnormal (= normal) held-out real test images.
        val_per_class: abnormal (= normal) real validation images (early stopping, best cycle).
        max_patient_images: at most this many images per patient (abnormal ones kept first; None: all).
        cycles: most cycles (one cycle = one epoch over all sites' images).
        patience: cycles without validation-loss improvement before stopping (the paper: 20
            epochs; 10 here for the 2-core budget: at 5, a seed's central hosting stopped at
            cycle 6 on a noisy 100-image validation loss and kept its untrained cycle 1).
        batch_size: minibatch size.
        lr: the global Adam learning rate.
        lr_decay: the rate's decay factor (the paper: 0.99).
        lr_decay_every: iterations between two decays; None: one epoch over the training set
            (the paper's 200 iterations were one epoch of its 6,400 images at batch 32).
        weight_decay: the L2 coefficient (the paper: 1e-4).
        augment: random rotation/flip/zoom/contrast.
        threads: torch CPU threads per process (1 is fastest on a machine shared with other jobs).
        jobs: seeds run in parallel processes.
        data_seed: seed of the test/validation/training draws, the site partitions and the synthetic cohort.
        splits: which of the paper's splits 1-10 (both datasets unless ``synthetic_splits``).
        synthetic_images: images of the synthetic cohort (0: no synthetic table).
        synthetic_per_class: abnormal (= normal) synthetic training images.
        synthetic_test_per_class: abnormal (= normal) synthetic test images.
        synthetic_val_per_class: abnormal (= normal) synthetic validation images.
        synthetic_splits: the synthetic table's splits (None: ``splits``).
    """

    SECTION: ClassVar[str] = "bench"
    seeds: int = field(default=5, metadata={"ge": 1})
    image_size: int = field(default=64, metadata={"ge": 32})
    arch: str = field(default=ModelConfig.arch, metadata={"choices": ARCHS})
    per_class: int | None = field(default=None, metadata={"ge": 1})
    test_per_class: int = field(default=100, metadata={"ge": 1})
    val_per_class: int = field(default=50, metadata={"ge": 1})
    max_patient_images: int | None = field(default=20, metadata={"ge": 1})
    cycles: int = field(default=80, metadata={"ge": 1})
    patience: int = field(default=10, metadata={"ge": 1})
    batch_size: int = field(default=32, metadata={"ge": 1})
    lr: float = field(default=1e-3, metadata={"gt": 0})
    lr_decay: float = field(default=0.99, metadata={"gt": 0, "le": 1})
    lr_decay_every: int | None = field(default=None, metadata={"ge": 1})
    weight_decay: float = field(default=1e-4, metadata={"ge": 0})
    augment: bool = True
    threads: int = field(default=1, metadata={"ge": 1})
    jobs: int = field(default=2, metadata={"ge": 1})
    data_seed: int = field(default=0, metadata={"ge": 0})
    splits: tuple[int, ...] = tuple(range(1, 11))
    synthetic_images: int = field(default=3000, metadata={"ge": 0})
    synthetic_per_class: int = field(default=400, metadata={"ge": 1})
    synthetic_test_per_class: int = field(default=500, metadata={"ge": 1})
    synthetic_val_per_class: int = field(default=100, metadata={"ge": 1})
    synthetic_splits: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("splits", "synthetic_splits"):
            bad = [s for s in getattr(self, key) or () if not 1 <= s <= 10]
            if bad:
                self.fail(key, f"must be among the paper's splits 1-10, got {bad}")
        if not self.synthetic_splits:  # none given: ``splits`` (stored as null, as before)
            object.__setattr__(self, "synthetic_splits", None)

    @property
    def datasets(self) -> tuple[str, ...]:
        """The pools benchmarked."""
        return DATASETS if self.synthetic_images else DATASETS[:1]

    def splits_of(self, dataset: str) -> tuple[int, ...]:
        """The splits run on one dataset."""
        return (self.synthetic_splits or self.splits) if dataset == "synthetic" else self.splits

    def data_args(self, dataset: str) -> dict[str, Any]:
        """:func:`cxrfl.bench.cwt_data.prepare_data`'s sizes for one dataset."""
        if dataset == "synthetic":
            return {
                "per_class": self.synthetic_per_class,
                "test_per_class": self.synthetic_test_per_class,
                "val_per_class": self.synthetic_val_per_class,
                "max_patient_images": self.max_patient_images,
            }
        return {
            "per_class": self.per_class,
            "test_per_class": self.test_per_class,
            "val_per_class": self.val_per_class,
            "max_patient_images": self.max_patient_images,
        }

    def cwt_config(self, seed: int, n_train: int, **flags: bool) -> CWTConfig:
        """The run's CWT settings.

        Args:
            seed: the training seed.
            n_train: training images over all sites (one epoch: the decay interval when not given).
            flags: the optimizations switched on (``plti=True`` ...).
        """
        every = self.lr_decay_every or max(1, round(n_train / self.batch_size))
        return CWTConfig(
            task="binary",
            num_cycles=self.cycles,
            order="fixed",
            lr=self.lr,
            lr_decay=self.lr_decay,
            lr_decay_every=every,
            weight_decay=self.weight_decay,
            batch_size=self.batch_size,
            patience=self.patience,
            augment=self.augment,
            seed=seed,
            **flags,
        )

    def run_key(self, dataset: str, n_train: int) -> dict[str, Any]:
        """The settings a kept run of ``dataset`` must share to be reused (not seeds, splits, threads, jobs)."""
        keep = (
            "image_size",
            "arch",
            "cycles",
            "patience",
            "batch_size",
            "lr",
            "lr_decay",
            "lr_decay_every",
            "weight_decay",
            "augment",
            "data_seed",
        )
        key = {k: getattr(self, k) for k in keep}
        if dataset == "synthetic":
            key["synthetic_images"] = self.synthetic_images
        return {**key, **self.data_args(dataset), "dataset": dataset, "n_train": n_train}


# ----------------------------------------------------------------------- runs
def _signature(split_key: Any, sites: Sequence[CWTSite], config: CWTConfig) -> tuple:
    """What a run computes: runs with equal signatures are bit-for-bit the same run."""
    plan = relay_plan({s.name: s.num_train for s in sites}, config)
    weights = [w for s in sites for w in s.loss_weights if w is not None]
    # every weight exactly 1 (or CWL off): the plain loss
    cwl = None if all(bool((w == 1.0).all()) for w in weights) else tuple(tuple(w.tolist()) for w in weights)
    return (split_key, tuple((s, v.steps, round(v.lr, 15)) for s, v in plan.items()), config.lwms, cwl, config.seed)


def _evaluate(result: CWTResult, test: CWTSite, where: dict[str, Any]) -> dict[str, Any]:
    summary = eval_summary(test.evaluate(result.model, "test"))
    return {
        "accuracy": summary["accuracy"],
        "auroc": summary["mean_auroc"],
        "test_loss": summary["loss"],
        "n_test": summary["n"],
        "best_cycle": result.best_cycle,
        "best_val_loss": result.best_val_loss,
        "cycles_run": result.cycles_run,
        "stopped_early": result.stopped_early,
        "val_curve": [h["val_loss"] for h in result.history],
        "seconds": round(result.seconds, 1),
        "plan": {s: {"steps": v.steps, "lr": v.lr} for s, v in result.plan.items()},
        **where,
    }


def run_file(folder: Path, method: str, split: int, seed: int) -> Path:
    """Where one finished run is kept (``runs/<dataset>/<method>__split<k>__seed<s>.json``).

    Args:
        folder: the dataset's ``runs`` folder.
        method: the method label.
        split: the split (0: central hosting).
        seed: the training seed.
    """
    return folder / f"{re.sub(r'[^A-Za-z0-9+]+', '_', method)}__split{split}__seed{seed}.json"


def load_runs(folder: Path, key: dict[str, Any]) -> dict[tuple[int, int, str], dict[str, Any]]:
    """The finished runs kept under ``folder`` with these settings, by (seed, split, method).

    A run kept under another cycle cap is reused when early stopping ended it within this cap:
    the cap never bound it, so it is the run this benchmark would train. A run that reached its
    cap (still improving) is trained again. A run kept before ``arch`` was recorded trained DenseNet121.

    Args:
        folder: the dataset's ``runs`` folder.
        key: :meth:`CWTBenchSettings.run_key` of this benchmark.
    """
    done, cap = {}, key["cycles"]
    for path in sorted(folder.glob("*.json")):
        try:
            saved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        kept, r = saved.get("settings") or {}, saved.get("run") or {}
        unbound = r.get("stopped_early") and r.get("cycles_run", cap + 1) <= cap  # early stopping ended it within cap
        if {**with_arch(kept), "cycles": cap} == key and (kept.get("cycles") == cap or unbound):
            done[(r["seed"], r["split"], r["method"])] = r
    return done


class _Runner:
    """Trains (or reuses) the runs of one dataset, keeping each as soon as it is done."""

    def __init__(
        self,
        settings: CWTBenchSettings,
        dataset: str,
        data: CWTBenchData,
        out: Path,
        log: Callable[[str], None],
        resume: bool = True,
    ) -> None:
        self.settings, self.dataset, self.log = settings, dataset, log
        self.folder = out / "runs" / dataset
        self.n_train = len(data.train)
        self.key = settings.run_key(dataset, self.n_train)
        self.done = load_runs(self.folder, self.key) if resume else {}
        self.model_config = ModelConfig(arch=settings.arch, image_size=settings.image_size)
        base = settings.cwt_config(0, self.n_train)
        self.test = CWTSite(data.test_site(), base, self.model_config)
        self.splits = settings.splits_of(dataset)
        self.sites = {split: [CWTSite(d, base, self.model_config) for d in data.sites(split)] for split in self.splits}
        self.sites[0] = [CWTSite(data.central(), base, self.model_config)]
        self.quotas = {0: None, **{s: tuple(data.splits[s]) for s in self.splits}}
        # the code this process loaded and where it computes, kept with every run it trains
        self.where = {"code": code_version(), "machine": machine(torch.device("cpu"))}

    def seed(self, seed: int) -> list[dict[str, Any]]:
        """Central hosting and every split's methods for one seed; their records."""
        seen: dict[tuple, dict[str, Any]] = {}
        records = []
        for split, method in [(0, CENTRAL)] + [(s, m) for s in self.splits for m in SPLIT_METHODS[s]]:
            cfg = self.settings.cwt_config(seed, self.n_train, **METHODS.get(method, {}))
            sites = self.sites[split]
            for s in sites:
                s.configure(cfg)
            sig = _signature(self.quotas[split], sites, cfg)
            r = self.done.get((seed, split, method))
            if r is None and sig in seen:
                src = seen[sig]
                r = {**src, "split": split, "method": method, "same_as": f"split {src['split']} {src['method']}"}
            elif r is None:
                r = {
                    "dataset": self.dataset,
                    "seed": seed,
                    "split": split,
                    "method": method,
                    **_evaluate(run_cwt(sites, cfg, model_config=self.model_config), self.test, self.where),
                }
                self.keep(r)
            if not r.get("same_as"):
                seen.setdefault(sig, r)
            records.append(r)
            note = f" (= {r['same_as']})" if r.get("same_as") else f" ({r['seconds']}s, best cycle {r['best_cycle']})"
            where = CENTRAL if split == 0 else f"split {split} {method}"
            self.log(f"{self.dataset} seed {seed} {where}: accuracy {r['accuracy']:.3f} AUROC {r['auroc']:.3f}{note}")
        return records

    def keep(self, run: dict[str, Any]) -> None:
        self.done[(run["seed"], run["split"], run["method"])] = run
        write_json(run_file(self.folder, run["method"], run["split"], run["seed"]), {"settings": self.key, "run": run})


def _data(settings: CWTBenchSettings, dataset: str, site_config: Path) -> CWTBenchData:
    return prepare_data(
        **settings.data_args(dataset),
        data_seed=settings.data_seed,
        splits=settings.splits_of(dataset),
        site_config=site_config,
    )


def _seed_task(
    settings: CWTBenchSettings, dataset: str, site_config: Path, seed: int, out: Path, resume: bool
) -> list[dict]:
    """One (dataset, seed) in a worker process; its progress lines go to that process's stdout."""
    torch.set_num_threads(settings.threads)
    runner = _Runner(
        settings,
        dataset,
        _data(settings, dataset, site_config),
        out,
        lambda m: print(f"[{dataset} seed {seed}] {m}", flush=True),
        resume,
    )
    return runner.seed(seed)


def _run_seeds(
    settings: CWTBenchSettings, pools: dict[str, Path], out: Path, log: Callable[[str], None], resume: bool
) -> dict[str, list[dict[str, Any]]]:
    """Every (dataset, seed), in ``jobs`` processes (one: in this process); the records per dataset."""
    tasks = [(d, s) for d in pools for s in range(settings.seeds)]
    records: dict[str, list[dict[str, Any]]] = {d: [] for d in pools}
    if settings.jobs > 1 and len(tasks) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(
            min(settings.jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn")
        ) as pool:
            futures = {pool.submit(_seed_task, settings, d, pools[d], s, out, resume): d for d, s in tasks}
            for fut, dataset in futures.items():
                records[dataset] += fut.result()
        return records
    runners = {d: _Runner(settings, d, _data(settings, d, pools[d]), out, log, resume) for d in pools}
    for dataset, seed in tasks:
        records[dataset] += runners[dataset].seed(seed)
    return records


def _dataset_part(
    settings: CWTBenchSettings, dataset: str, site_config: Path, runs: list[dict[str, Any]], out: Path
) -> dict[str, Any]:
    """One dataset's entry of ``results.json`` (its plots written)."""
    data = _data(settings, dataset, site_config)
    splits = settings.splits_of(dataset)
    summary = summarise(runs, dataset, splits, len(data.test), settings.seeds)
    plots = [f"cwt_{dataset}.png", f"cwt_curves_{dataset}.png"]
    plot(summary, out / plots[0], DATASET_TITLES[dataset])
    plot_curves(runs, [s for s in (5, 10) if s in splits] or list(splits[:1]), out / plots[1])
    return {
        "data": {
            "source": str(site_config),
            "test_images": len(data.test),
            "val_images": len(data.val),
            "train_images": len(data.train),
            "train_patients": int(data.train["patient"].nunique()),
            "splits": {str(k): v for k, v in data.splits.items()},
        },
        "summary": summary,
        "plots": plots,
    }


def run_cwt_benchmark(
    out: str | Path = REPO / "benchmarks" / "results" / "cwt",
    seeds: int | None = None,
    *,
    settings: CWTBenchSettings | None = None,
    site_config: str | Path = DEFAULT_SITE_CONFIG,
    data_root: str | Path | None = None,
    log: Callable[[str], None] = logger.info,
    resume: bool = True,
    command: str | None = None,
) -> dict[str, Any]:
    """Run the CWT benchmark; write ``results.json``, ``report.md`` and the plots to ``out``.

    Each finished (dataset, method, split, seed) run is kept in ``out/runs`` at once; a later call
    with the same settings reuses those runs and trains only the missing ones.

    Args:
        out: output folder.
        seeds: training seeds 0 .. seeds-1 (None: ``settings.seeds``).
        settings: everything else (default: :class:`CWTBenchSettings`).
        site_config: the real images' site config (nih1000).
        data_root: where the synthetic cohort is written (default ``$CXRFL_DEMO_DIR`` or
            ``~/.cache/cxrfl``, then ``cwt-bench``); reused when already there.
        log: progress lines.
        resume: reuse the finished runs kept in ``out/runs`` (False: train every run again).
        command: the command line, for the report.

    Returns:
        The content of ``results.json``.
    """
    settings = settings or CWTBenchSettings()
    if seeds is not None:
        settings = replace(settings, seeds=seeds)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(settings.threads)
    start, cpu_start = time.perf_counter(), time.process_time()
    pools = {"nih1000": Path(site_config)}
    if "synthetic" in settings.datasets:
        root = Path(
            data_root or Path(os.environ.get("CXRFL_DEMO_DIR") or Path.home() / ".cache" / "cxrfl") / "cwt-bench"
        )
        pools["synthetic"] = synthetic_site_config(
            root, settings.synthetic_images, settings.image_size, settings.data_seed
        )
    records = _run_seeds(settings, pools, out, log, resume)
    result = {
        "settings": settings.to_dict(),
        "machine": machine(torch.device("cpu")),
        "command": command or command_line() or f"cxrfl bench cwt --seeds {settings.seeds} --out {out}",
        "datasets": {d: _dataset_part(settings, d, pools[d], records[d], out) for d in pools},
        "results": {d: results_table(records[d]) for d in pools},
        "runs": [r for d in pools for r in records[d]],
        "seconds": round(time.perf_counter() - start, 1),
        "cpu_seconds": round(time.process_time() - cpu_start, 1),
    }
    result["provenance"] = provenance(result["runs"])
    write_json(out / "results.json", result)
    (out / "report.md").write_text(report_markdown(result))
    log(f"wrote {out / 'results.json'}, {out / 'report.md'} and the plots in {result['seconds']:.0f}s")
    return result
