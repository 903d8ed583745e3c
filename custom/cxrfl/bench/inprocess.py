"""Set-up shared by the benchmarks that run surgical aggregation's server loop in this process
(``cxrfl bench privacy``, ``hostile``, ``quantize``): the profile's data and test sets, the server
settings of a run, the results file an interrupted benchmark resumes from, where the numbers came from,
and the scoring of the selected global model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from cxrfl.bench.arch import with_arch
from cxrfl.bench.evaluate import TestSet, load_test_set, scores_on
from cxrfl.bench.intervals import finite_mean
from cxrfl.bench.profiles import BenchData, prepare
from cxrfl.bench.protocol import code_version, command_line, machine
from cxrfl.common.config import Config
from cxrfl.common.io import write_json
from cxrfl.errors import ConfigError
from cxrfl.nn.metrics import per_class_auroc
from cxrfl.nn.models import ARCHS, ModelConfig
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.config import SurgicalConfig


def load_profile(
    profile: str,
    out: Path,
    *,
    image_size: int,
    data_dir: str | Path | None = None,
    external_only: bool = True,
    **sizes: Any,
) -> tuple[BenchData, dict[str, TestSet]]:
    """Write (or reuse) a profile's data and read the test sets the selected models are scored on.

    Args:
        profile: a benchmark profile (:func:`cxrfl.bench.profiles.prepare`).
        out: the benchmark's output folder (data goes to ``out/data`` unless ``data_dir``).
        image_size: model input size.
        data_dir: where profile data is written.
        external_only: refuse a profile without an external test set; False: such a profile is scored
            on the sites' test splits.
        sizes: more :func:`cxrfl.bench.profiles.prepare` arguments (``n_per_site``, ``n_sites``).
    """
    data = prepare(profile, Path(data_dir) if data_dir else out / "data", image_size=image_size, **sizes)
    if data.external:
        return data, {
            n: load_test_set(d, kind="external", classes=data.union, image_size=image_size)
            for n, d in data.external.items()
        }
    if external_only:
        raise ConfigError(f"profile {profile} has no external test set to score the models on")
    return data, {s.site: load_test_set(s, kind="site", classes=data.union, image_size=image_size) for s in data.sites}


def surgical_config(
    train: TrainConfig, *, rounds: int, patience: int, image_size: int, arch: str, **extra: Any
) -> SurgicalConfig:
    """The server settings of one benchmark run: two sites needed, none waited for, no test evaluation
    or round checkpoints (the benchmark scores the selected model itself).

    Args:
        train: the sites' training settings (their ``seed`` is the run's).
        rounds: most rounds after the warm-up.
        patience: rounds without a better mean validation loss before stopping.
        image_size: model input size (trained from scratch).
        arch: the network (:mod:`cxrfl.bench.arch`).
        extra: other :class:`cxrfl.surgical.config.SurgicalConfig` settings (``weighting``, ``robust`` ...).
    """
    return SurgicalConfig(
        num_rounds=rounds,
        min_clients=2,
        model_config=ModelConfig(arch=arch, image_size=image_size),
        train_config=train,
        patience=patience,
        min_clients_timeout=0,
        seed=train.seed,
        evaluate_test=False,
        keep_round_checkpoints=False,
        **extra,
    )


def open_results(out: Path, settings: Any) -> tuple[Path, dict[str, Any]]:
    """Make the output folder, set torch's threads and read the results written so far, to go on from.

    Args:
        out: the benchmark's output folder.
        settings: the benchmark's settings (a dataclass with ``threads``).

    Returns:
        the ``results.json`` path and its results (``{"runs": {}}`` when none).

    Raises:
        ConfigError: the file holds runs of other settings (one line; settings stored before ``arch`` was
            recorded trained DenseNet121).
    """
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(settings.threads)
    path = out / "results.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {"runs": {}}
    plain = json.loads(json.dumps(asdict(settings)))  # as results.json holds them (lists, not tuples)
    if with_arch(results.get("settings", plain)) != plain:
        raise ConfigError(f"{path} holds runs of other settings; use another --out or remove it")
    results["settings"] = plain
    return path, results


def save_results(path: Path, results: Mapping[str, Any]) -> None:
    """Write ``results.json`` atomically (an interrupted benchmark never leaves half a file).

    Args:
        path: the file.
        results: the results so far.
    """
    write_json(path, results)


@dataclass(frozen=True)
class LocalTraining(Config):
    """How the sites of a benchmark that sets its own training settings train (privacy, hostile).

    Args:
        image_size: model input size.
        arch: the network (:mod:`cxrfl.bench.arch`).
        steps: cap on optimiser steps per local epoch and site (None: the whole split).
        warmup_epochs: head warm-up epochs.
        batch_size: minibatch size.
        lr: learning rate of the rounds.
        warmup_lr: learning rate of the warm-up.
    """

    SECTION: ClassVar[str] = "bench"
    image_size: int = field(default=64, metadata={"ge": 8})
    arch: str = field(default=ModelConfig.arch, metadata={"choices": ARCHS})
    steps: int | None = field(default=None, metadata={"ge": 1})
    warmup_epochs: int = field(default=1, metadata={"ge": 0})
    batch_size: int = field(default=16, metadata={"ge": 1})
    lr: float = field(default=1e-3, metadata={"gt": 0})
    warmup_lr: float = field(default=5e-3, metadata={"gt": 0})

    def train_config(self, seed: int) -> TrainConfig:
        """The sites' training settings of one run.

        Args:
            seed: the training seed.
        """
        return TrainConfig(
            lr=self.lr,
            warmup_lr=self.warmup_lr,
            warmup_epochs=self.warmup_epochs,
            batch_size=self.batch_size,
            max_steps_per_epoch=self.steps,
            seed=seed,
        )


RunOne = Callable[[Path], dict[str, Any]]
"""One benchmark run: given a scratch folder of its own, its result (JSON-safe)."""


def run_pending(
    path: Path,
    results: dict[str, Any],
    plan: Iterable[tuple[str, RunOne]],
    *,
    describe: Callable[[dict[str, Any]], str],
    log: Callable[[str], None],
    prefix: str = "cxrfl-bench-",
) -> None:
    """Run each planned run whose key ``results["runs"]`` lacks; record and save each as it finishes.

    An interrupted benchmark resumes with the runs not saved yet. Each run is stamped with the code and
    the machine that ran it (a run resumed in a later session may run other code, on another CPU) and
    logged as one line with the time.

    Args:
        path: ``results.json``.
        results: :func:`open_results`' results, with :func:`provenance`'s ``code`` and ``machine``.
        plan: (key, run) in order; a generator may set up what a group of runs shares as it goes.
        describe: a finished run's log line (after its elapsed time).
        log: progress callback.
        prefix: the scratch folder's name prefix (the folder is removed at the end, failed or not).
    """
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        for key, run_one in plan:
            if key in results["runs"]:
                continue
            run = run_one(work)
            run["code"], run["machine"] = results["code"], results.get("machine")
            results["runs"][key] = run
            save_results(path, results)
            log(f"[{time.perf_counter() - start:7.0f}s] {describe(run)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def provenance() -> dict[str, Any]:
    """Where the numbers come from: ``code`` (commit, modified), ``machine`` (CPU, threads, load) and
    ``command_line``."""
    return {"code": code_version(), "machine": machine(torch.device("cpu")), "command_line": command_line()}


def mean_auroc(model: torch.nn.Module | None, classes: list[str], tests: Mapping[str, Any]) -> float | None:
    """A global model's mean AUROC over every class of the test sets; a class the model lacks (its only
    site was rejected) or scores with NaN (an attack broke it), or no model at all, counts 0.5 (no skill).

    Args:
        model: the selected global model (None: the run left none).
        classes: its classes.
        tests: the test sets.
    """
    values: list[float | None] = []
    for test in tests.values():
        if model is None:
            values += [0.5] * len(test.classes)
            continue
        scores = scores_on(model, classes, test)
        usable = [j for j in range(len(test.classes)) if np.isfinite(scores[:, j]).all()]
        aurocs = per_class_auroc(test.labels[:, usable], scores[:, usable], [test.classes[j] for j in usable])
        values += [aurocs.get(c, 0.5) for c in test.classes]
    return finite_mean(values)


def num(v: float | None) -> str:
    """A report's number: three decimals, ``n/a`` for None.

    Args:
        v: the number.
    """
    return "n/a" if v is None else f"{v:.3f}"
