"""Parts ``training`` and ``accuracy`` of ``cxrfl bench speed``: the default precision and memory
format of this machine (:mod:`cxrfl.nn.precision`, ``auto``) against float32 NCHW.

- ``training``: images/s of DenseNet121 training steps (forward, backward, Adam) on the same
  in-memory batches, the two settings taking turns in one run (repeats alternate which goes
  first), each with its own model and optimiser after a short warm-up.
- ``accuracy``: the same short training in both settings (default: 8 epochs of the
  two-hospitals hospital-a split at 64 px, Adam 1e-3, batch 32, 3 seeds; the same seed gives both
  the same initial weights, order and augmentation), then mean test AUROC, each evaluated on its
  own inference path.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from cxrfl.common.config import Config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingSpeedSettings(Config):
    """What the two parts run.

    Args:
        image_size: model input of the throughput part.
        batch_size: minibatch size of both parts.
        steps: optimiser steps per timed repeat.
        repeats: timed repeats of each setting.
        threads: torch threads (0: torch's default).
        epochs: training epochs of the accuracy part.
        seeds: seeds of the accuracy part.
        accuracy_image_size: model input (and synthetic image size) of the accuracy part.
        n_images: images of the synthetic site of the accuracy part (None: the profile's).
        device: ``cpu`` or ``cuda`` (a GPU: float32 NCHW against its own ``auto``).
    """

    SECTION: ClassVar[str] = "bench"
    image_size: int = field(default=64, metadata={"ge": 32})
    batch_size: int = field(default=32, metadata={"ge": 1})
    steps: int = field(default=10, metadata={"ge": 1})
    repeats: int = field(default=3, metadata={"ge": 1})
    threads: int = field(default=1, metadata={"ge": 0})
    epochs: int = field(default=8, metadata={"ge": 1})
    seeds: int = field(default=3, metadata={"ge": 1})
    accuracy_image_size: int = field(default=64, metadata={"ge": 32})
    n_images: int | None = field(default=None, metadata={"ge": 1})
    device: str = "cpu"


def settings_compared(device: str = "cpu") -> dict[str, Any]:
    """``fp32`` (float32, NCHW) and ``default`` (``auto``: what this machine resolves to) on ``device``.

    Args:
        device: ``cpu`` or ``cuda``.
    """
    from cxrfl.nn.models import select_device
    from cxrfl.nn.precision import Compute, resolve

    dev = select_device(device)
    return {"fp32": Compute(dev, "fp32", False), "default": resolve("auto", "auto", dev)}


def synthetic_batches(s: TrainingSpeedSettings, k: int) -> list[tuple[Any, Any, Any]]:
    """``s.steps`` seeded random batches (images, targets, masks) of ``s.batch_size`` RGB images, ``k`` classes.

    Args:
        s: settings (``steps``, ``batch_size``, ``image_size``).
        k: number of classes.
    """
    import torch

    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(s.batch_size, 3, s.image_size, s.image_size, generator=g),
            (torch.rand(s.batch_size, k, generator=g) > 0.8).float(),
            torch.ones(s.batch_size, k),
        )
        for _ in range(s.steps)
    ]


def training_benchmark(s: TrainingSpeedSettings, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Images/s of float32 NCHW and of the default, interleaved in this run.

    Args:
        s: settings.
        log: progress callback.
    """
    import torch

    from cxrfl.nn.models import ModelConfig, build_model
    from cxrfl.nn.threads import torch_threads
    from cxrfl.nn.training import adam, train_epochs

    computes = settings_compared(s.device)
    batches = synthetic_batches(s, 14)
    runs = {}
    with torch_threads(s.threads or torch.get_num_threads()):
        for name, compute in computes.items():
            torch.manual_seed(0)
            model = build_model(ModelConfig(image_size=s.image_size), 14)
            opt = adam(model, 1e-3)
            train_epochs(model, batches[:2], opt, compute)  # kernels, allocator and formats warmed up
            runs[name] = (model, opt, compute)
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(s.repeats):
            for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                model, opt, compute = runs[name]
                rates[name].append(train_epochs(model, batches, opt, compute).images_per_second)
                log(f"training {name} ({compute.describe()}): {rates[name][-1]:.1f} images/s")
        threads = torch.get_num_threads()
    fp32, default = statistics.mean(rates["fp32"]), statistics.mean(rates["default"])
    d = computes["default"]
    return {
        "fp32_img_s": fp32,
        "default_img_s": default,
        "ratio": default / fp32 if fp32 else None,
        "precision": d.precision,
        "channels_last": d.channels_last,
        "images_per_second": rates,
        "threads": threads,
        "image_size": s.image_size,
        "batch_size": s.batch_size,
        "steps": s.steps,
        "repeats": s.repeats,
        "device": str(d.device),
    }


def _train_and_test(data: Any, compute: Any, seed: int, s: TrainingSpeedSettings) -> tuple[float | None, float]:
    """One seed's training in one setting: (mean test AUROC, seconds)."""
    import torch

    from cxrfl.data.dataset import make_loader
    from cxrfl.nn.models import ModelConfig, build_model
    from cxrfl.nn.training import adam, evaluate, train_epochs

    size = s.accuracy_image_size
    torch.manual_seed(seed)
    model = build_model(ModelConfig(image_size=size), len(data.classes))
    opt = adam(model, 1e-3)
    train = make_loader(
        data.split_table("train"), data.classes, image_size=size, train=True, batch_size=s.batch_size, seed=seed
    )
    test = make_loader(data.split_table("test"), data.classes, image_size=size, train=False, batch_size=64)
    start = time.perf_counter()
    train_epochs(model, train, opt, compute, epochs=s.epochs)
    seconds = time.perf_counter() - start
    return evaluate(model, test, data.classes, compute).mean_auroc, seconds


def accuracy_benchmark(
    s: TrainingSpeedSettings, work: Path, log: Callable[[str], None] = logger.info
) -> dict[str, Any]:
    """Mean test AUROC after the same short training in float32 NCHW and in the default.

    Args:
        s: settings.
        work: where the synthetic site is written.
        log: progress callback.
    """
    import numpy as np
    import torch

    from cxrfl.data.site import load_site
    from cxrfl.nn.threads import torch_threads
    from cxrfl.synth import write_profile

    sized = {"n_per_site": s.n_images} if s.n_images else {}
    (config,) = write_profile(
        "two-hospitals", Path(work) / "data", image_size=s.accuracy_image_size, sites=["hospital-a"], **sized
    )
    data = load_site(config, check_images=False)
    computes = settings_compared(s.device)
    auroc: dict[str, list[float | None]] = {name: [] for name in computes}
    seconds: dict[str, list[float]] = {name: [] for name in computes}
    with torch_threads(s.threads or torch.get_num_threads()):
        for seed in range(s.seeds):
            for name in list(computes) if seed % 2 == 0 else list(computes)[::-1]:
                a, t = _train_and_test(data, computes[name], seed, s)
                auroc[name].append(a)
                seconds[name].append(t)
                log(
                    f"accuracy seed {seed} {name} ({computes[name].describe()}): mean test AUROC {a}, {t:.0f}s training"
                )
    diffs = [d - f for f, d in zip(auroc["fp32"], auroc["default"]) if f is not None and d is not None]
    mean = {
        name: float(np.mean([v for v in vals if v is not None])) if any(v is not None for v in vals) else None
        for name, vals in auroc.items()
    }
    d = computes["default"]
    return {
        "fp32_mean_auroc": mean["fp32"],
        "default_mean_auroc": mean["default"],
        "auroc": auroc,
        "difference": float(np.mean(diffs)) if diffs else None,
        "difference_sd": float(np.std(diffs, ddof=1)) if len(diffs) > 1 else None,
        "training_seconds": seconds,
        "precision": d.precision,
        "channels_last": d.channels_last,
        "site": data.site,
        "train_images": len(data.split_table("train")),
        "test_images": len(data.split_table("test")),
        "epochs": s.epochs,
        "seeds": s.seeds,
        "image_size": s.accuracy_image_size,
        "batch_size": s.batch_size,
        "lr": 1e-3,
    }
