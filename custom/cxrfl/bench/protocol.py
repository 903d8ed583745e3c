"""The protocol of ``cxrfl bench compare``: its settings, converged by default, a quick smoke preset,
and what identifies a run (settings that decide the models, code, machine).

The default protocol (issue 14): DenseNet121 from scratch at 64 px, Adam 1e-3, batch 32 (settings
measured to learn from scratch here: about 0.72-0.75 mean test AUROC on hospital-a after 7-9
epochs), a one-epoch head warm-up (lr 5e-3, feature extractor frozen), then federated rounds of one
local epoch over whole training splits until the mean validation BCE of the sites has not improved
(by ``min_delta``) for ``patience`` rounds, ``max_rounds`` only as a guard; the individually
trained and centralized baselines run the same loop on one site, so they train epochs until their
validation loss stops improving. Five seeds. :data:`QUICK` is a minutes-long smoke version whose
numbers mean nothing.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from cxrfl.bench.methods import Method
from cxrfl.bench.profiles import SYNTH_SPLIT
from cxrfl.common.config import Config
from cxrfl.nn.models import ARCHS, ModelConfig
from cxrfl.nn.precision import cpu_has_native_bf16
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.head_modes import SELECTION_RULES

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class CompareSettings(Config):
    """Settings of one comparison (every method shares them).

    Args:
        profile: benchmark profile (:data:`cxrfl.bench.profiles.PROFILE_NAMES`), or the name of
            your own data with ``site_configs``.
        seeds: training seeds 0 ... seeds-1 (initial weights, data order; data and splits fixed).
        max_rounds: most federated rounds (= epochs of the one-site baselines) after the warm-up:
            a guard only, early stopping ends the runs.
        patience: rounds without an improvement of the mean validation loss before stopping.
        min_delta: smaller improvements do not count.
        image_size: model input size.
        data_image_size: size synthetic images are written at (at least ``image_size`` is used).
        n_per_site: images per synthetic hospital, or of the synth-nih pool (None: the profile's default).
        n_external: images of the synthetic external test site (None: the profile's default).
        split: train/val/test fractions of the synthetic hospitals (by patient).
        steps: cap on optimiser steps per local epoch and site (None: whole splits, the protocol;
            a cap is for smoke runs); the centralized baseline gets the sum over sites.
        warmup_epochs: head warm-up epochs (feature extractor frozen), shared by all methods of a seed.
        batch_size: minibatch size.
        lr: Adam learning rate of the rounds.
        warmup_lr: learning rate of the head warm-up.
        augment: augment training images.
        methods: method names (None: :data:`cxrfl.bench.methods.DEFAULT_METHODS`).
        n_boot: bootstrap resamples per seed (per-class intervals).
        n_sites: pool profiles: number of sites (ablation).
        n_shared: pool profiles: classes every site annotates (ablation).
        threads: torch CPU threads per process (None: torch's default, every core; 1 on a machine
            others share, and with ``jobs`` > 1).
        jobs: (method, seed) runs trained side by side in worker processes (1: in this process). On
            this 2-core CPU machine two one-thread jobs train 1.5x as many images per second as one
            two-thread process; each job repeats the head warm-up its seed's other methods share.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        pretrained: a local feature-extractor checkpoint (e.g. ImageNet DenseNet121 weights, as the
            papers start from; needed by the FedBN+ methods); None: from scratch.
        arch: the network (:mod:`cxrfl.bench.arch`; DenseNet121 unless given).
        site_configs: your own training sites' config files instead of a built-in profile.
        external_configs: your own fully annotated external test sets (with ``site_configs``).
        selection: what the validation loss that selects each model counts
            (:data:`cxrfl.surgical.head_modes.SELECTION_RULES`; ``annotated``: each site's own
            classes, the same rule for every method; ``head``: the rule before issue 41).
    """

    SECTION: ClassVar[str] = "compare"
    profile: str = "two-hospitals"
    seeds: int = field(default=5, metadata={"ge": 1})
    max_rounds: int = field(default=40, metadata={"ge": 1})
    patience: int = field(default=5, metadata={"ge": 1})
    min_delta: float = field(default=1e-4, metadata={"ge": 0})
    image_size: int = field(default=64, metadata={"ge": 32})
    data_image_size: int = field(default=64, metadata={"ge": 16})
    n_per_site: int | None = field(default=None, metadata={"ge": 1})
    n_external: int | None = field(default=None, metadata={"ge": 1})
    split: tuple[float, ...] = SYNTH_SPLIT
    steps: int | None = field(default=None, metadata={"ge": 1})
    warmup_epochs: int = field(default=1, metadata={"ge": 0})
    batch_size: int = field(default=32, metadata={"ge": 1})
    lr: float = field(default=1e-3, metadata={"gt": 0})
    warmup_lr: float = field(default=5e-3, metadata={"gt": 0})
    augment: bool = True
    methods: tuple[str, ...] | None = None
    n_boot: int = field(default=1000, metadata={"ge": 1})
    n_sites: int | None = field(default=None, metadata={"ge": 1})
    n_shared: int | None = field(default=None, metadata={"ge": 0})
    threads: int | None = field(default=None, metadata={"ge": 1})
    jobs: int = field(default=1, metadata={"ge": 1})
    device: str = field(default="auto", metadata={"choices": DEVICES})
    pretrained: str | None = None
    arch: str = field(default=ModelConfig.arch, metadata={"choices": ARCHS})
    site_configs: tuple[str, ...] | None = None
    external_configs: tuple[str, ...] | None = None
    selection: str = field(default="annotated", metadata={"choices": SELECTION_RULES})

    def model_config(self) -> ModelConfig:
        """The network settings."""
        return ModelConfig(arch=self.arch, image_size=self.image_size, pretrained=self.pretrained)

    def train_config(self, seed: int) -> TrainConfig:
        """The sites' training settings for one seed.

        Args:
            seed: the training seed.
        """
        return TrainConfig(
            lr=self.lr,
            warmup_lr=self.warmup_lr,
            warmup_epochs=self.warmup_epochs,
            local_epochs=1,
            batch_size=self.batch_size,
            max_steps_per_epoch=self.steps,
            augment=self.augment,
            seed=seed,
        )

    def run_config(self, method: Method, seed: int, n_sites: int) -> SurgicalConfig:
        """The server settings of one run (the one-site baselines: surgical head, FedAvg, every class own).

        Args:
            method: the method.
            seed: the training seed.
            n_sites: the run's sites (all must answer every round).
        """
        federated = method.kind == "federated"
        return SurgicalConfig(
            num_rounds=self.max_rounds,
            min_clients=n_sites,
            model_config=self.model_config(),
            train_config=self.train_config(seed),
            batchnorm=method.batchnorm if federated else "fedavg",
            head_mode=method.head_mode if federated else "surgical",
            missing=method.missing if federated else "negative",
            selection=self.selection,
            patience=self.patience,
            min_delta=self.min_delta,
            min_clients_timeout=0,
            seed=seed,
            evaluate_test=False,
            keep_round_checkpoints=False,
        )

    def torch_device(self) -> torch.device:
        """The device the sites train on."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def protocol(self) -> dict[str, Any]:
        """The settings that decide the models (a stored run is reused only when they are equal):
        everything but :data:`RUN_ONLY`, plus the pretrained file's digest."""
        out = {k: v for k, v in self.to_dict().items() if k not in (*RUN_ONLY, "selection")}
        out["pretrained_sha256"] = file_digest(self.pretrained) if self.pretrained else None
        return out


RUN_ONLY = ("seeds", "methods", "n_boot", "threads", "jobs", "device")
"""Settings that do not decide any one run's model: how many seeds and which methods run, the
statistics, and where and how fast it computes (recorded per run). ``selection`` is left out of
the protocol too: it decides only the methods whose validation counts other sites' classes
(:attr:`cxrfl.bench.methods.Method.selection_matters`), so it is recorded in each run and a run of
the other rule is set aside and trained again (:meth:`cxrfl.bench.runs.RunStore.set_aside_selection`), except
in a profile where every site labels every class (the rules coincide there)."""

QUICK: dict[str, Any] = {
    "seeds": 2,
    "max_rounds": 3,
    "patience": 2,
    "image_size": 32,
    "data_image_size": 32,
    "n_per_site": 120,
    "n_external": 120,
    "steps": 5,
    "batch_size": 16,
    "n_boot": 200,
}
"""``--quick``: a smoke run of a few minutes (tiny data, step caps): the code path, no evidence."""


def file_digest(path: str | Path) -> str | None:
    """SHA-256 of a file (None when it does not exist).

    Args:
        path: the file.
    """
    p = Path(path)
    if not p.is_file():
        return None
    h = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


RESULTS_PATH = "benchmarks/results"
"""Stored benchmark results: rewritten while a benchmark runs, so not code changes."""


def code_version(root: str | Path | None = None) -> dict[str, Any]:
    """The git commit of a checkout, and whether tracked files other than stored benchmark
    results (:data:`RESULTS_PATH`) differ from it.

    Args:
        root: the checkout (None: the one this package runs from).
    """
    root = Path(root) if root is not None else Path(__file__).resolve().parents[3]

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = (
        git("status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS_PATH}") if commit else None
    )
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def command_line() -> str | None:
    """The ``cxrfl`` command line that trains this process's results, for a report (None: not run as ``cxrfl``).
    ``--report-only`` is left out: the results it rebuilds come from the same command without it."""
    if Path(sys.argv[0]).name != "cxrfl":
        return None
    return " ".join(["cxrfl", *(a for a in sys.argv[1:] if a != "--report-only")])


def code_label(code: dict[str, Any], digits: int = 7) -> str:
    """A :func:`code_version` record as a report names it: "`abc1234`", with " with uncommitted changes"
    where the checkout differed from the commit.

    Args:
        code: ``commit`` (None or missing: "unknown") and ``dirty``.
        digits: how many hex digits of the commit to show.
    """
    label = f"`{(code.get('commit') or 'unknown')[:digits]}`"
    return label + (" with uncommitted changes" if code.get("dirty") else "")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_text(record: dict[str, Any]) -> str:
    """The 1/5/15-min load average of a :func:`machine` record as a report writes it ("unknown": not
    recorded); reads ``load_average_at_start``, its name in results written before 2026-11-25 (a
    list, or the 1-min figure alone), too.

    Args:
        record: a machine record.
    """
    load = record.get("load_average")
    if load is None:
        load = record.get("load_average_at_start")
    if load is None:
        return "unknown"
    return ", ".join(f"{x:.1f}" for x in ([load] if isinstance(load, int | float) else load))


def machine(device: torch.device) -> dict[str, Any]:
    """Where a run computes: CPU model and capability (AVX2 / AVX512; native bf16, which ``precision: auto``
    trains in), cores, torch threads, the device, versions, and the load average
    (1, 5 and 15 min) when called, which says whether the machine was quiet.

    Args:
        device: the torch device the sites train on.
    """
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    info = {
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": cpu_has_native_bf16(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch_threads": torch.get_num_threads(),
        "device": device.type,
        "gpu": None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": load,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
