"""Framework-free local training and evaluation loops (plain PyTorch).

Used by the NVFlare executors, the baselines and the benchmarks alike, so that "inside the
simulator" and "plain PyTorch" run the very same code. Precision and memory format come from a
:class:`cxrfl.nn.precision.Compute` (a plain device means its ``auto`` settings).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from cxrfl.common.config import Config
from cxrfl.nn.losses import masked_bce
from cxrfl.nn.metrics import per_class_auroc, summarise_auroc
from cxrfl.nn.precision import LEGACY_AMP, Compute, as_compute, backward_step, channels_last_field, precision_field


class Batches(Protocol):
    """What the loops read: a sized iterable of batches (a DataLoader, a DeviceLoader, a list)."""

    def __iter__(self) -> Iterator[Any]: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class TrainConfig(Config):
    """Local optimisation settings; defaults are the surgical-aggregation papers' values.

    Args:
        lr: Adam learning rate of federated rounds (papers: 5e-5 from ImageNet weights).
        warmup_lr: learning rate of the head warm-up with a frozen feature extractor.
        warmup_epochs: head warm-up epochs before federated rounds (papers: 15).
        local_epochs: local epochs per round (papers: E = 1).
        batch_size: minibatch size (papers: 64).
        weight_decay: Adam weight decay.
        max_steps_per_epoch: cap on optimiser steps per epoch (None: the whole split).
        augment: random rotation/flip/zoom/contrast on training images.
        seed: seed of weight init, shuffling and augmentation.
        precision: ``auto`` (per device, :mod:`cxrfl.nn.precision`), ``fp32``, ``bf16`` or ``fp16``
            (autocast; weights and optimiser state stay float32).
        channels_last: ``auto`` (per device), true or false: channels-last memory format.
    """

    SECTION: ClassVar[str] = "train"
    LEGACY = LEGACY_AMP
    lr: float = field(default=5e-5, metadata={"gt": 0})
    warmup_lr: float = field(default=5e-3, metadata={"gt": 0})
    warmup_epochs: int = field(default=15, metadata={"ge": 0})
    local_epochs: int = field(default=1, metadata={"ge": 1})
    batch_size: int = field(default=64, metadata={"ge": 1})
    weight_decay: float = field(default=0.0, metadata={"ge": 0})
    max_steps_per_epoch: int | None = field(default=None, metadata={"ge": 1})
    augment: bool = True
    seed: int = 0
    precision: str = precision_field()
    channels_last: str | bool = channels_last_field()


@dataclass
class EpochStats:
    """What one call of :func:`train_steps` (:func:`train_epochs`) did.

    Args:
        loss: mean training loss over all steps.
        steps: optimiser steps taken.
        images: images processed.
        seconds: wall time.
        skipped: batches without a loss (no step).
    """

    loss: float
    steps: int
    images: int
    seconds: float
    skipped: int = 0

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


@dataclass
class EvalResult:
    """Validation/test outcome of one model on one split.

    Args:
        loss: mean masked BCE over known labels.
        aurocs: class -> AUROC, None where not defined (one label value only).
        y_true: [n, K] labels (0 where unknown).
        mask: [n, K] 1 where the label is known.
        scores: [n, K] predicted probabilities.
        classes: class order of the columns.
    """

    loss: float
    aurocs: dict[str, float | None]
    y_true: np.ndarray
    mask: np.ndarray
    scores: np.ndarray
    classes: list[str] = field(default_factory=list)

    @property
    def mean_auroc(self) -> float | None:
        """Mean over the classes whose AUROC is defined (None when none is)."""
        return summarise_auroc(self.aurocs)["mean"]


def _progress(iterable: Iterable, desc: str | None, total: int | None):
    return tqdm(iterable, desc=desc, total=total, leave=False, disable=desc is None or not sys.stderr.isatty())


StepLoss = Callable[[Any], "torch.Tensor | None"]
"""``step_loss(batch)``: one batch's loss, the forward pass included (None: skip the batch, no step)."""


def train_steps(
    loader: Batches,
    optimizer: torch.optim.Optimizer,
    compute: Compute,
    step_loss: StepLoss,
    *,
    epochs: int = 1,
    max_steps: int | None = None,
    desc: str | None = None,
    what: str = "training loss",
) -> EpochStats:
    """The one local training loop of every method: ``epochs`` passes over ``loader`` (at most ``max_steps``
    batches each), one optimiser step per batch whose loss ``step_loss`` computes (masked BCE here,
    SimSiam's and FedFew's stage-2 losses in :mod:`cxrfl.fedfew`).

    Args:
        loader: the batches (the first element of a batch: its images).
        optimizer: the optimiser over the trainable parameters.
        compute: device, precision and memory format (``step_loss`` runs its forward pass under its autocast).
        step_loss: the loss hook.
        epochs: number of passes over the loader.
        max_steps: cap on batches per epoch.
        desc: progress-bar label (None: no bar).
        what: names the loss in the error of a non-finite one.

    Raises:
        FloatingPointError: a loss became NaN or infinite.
    """
    scaler = compute.scaler()
    total_loss, steps, images, skipped = 0.0, 0, 0, 0
    start = time.perf_counter()
    for _ in range(epochs):
        n = len(loader) if max_steps is None else min(len(loader), max_steps)
        for i, batch in enumerate(_progress(loader, desc, n)):
            if max_steps is not None and i >= max_steps:
                break
            optimizer.zero_grad(set_to_none=True)
            loss = step_loss(batch)
            if loss is None:
                skipped += 1
                continue
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{what} became {loss.item()} at step {steps}")
            backward_step(loss, optimizer, scaler)
            total_loss += float(loss.detach())
            steps += 1
            images += int(batch[0].shape[0])
    seconds = time.perf_counter() - start
    return EpochStats(loss=total_loss / max(steps, 1), steps=steps, images=images, seconds=seconds, skipped=skipped)


def train_epochs(
    model: nn.Module,
    loader: Batches,
    optimizer: torch.optim.Optimizer,
    compute: Compute | torch.device,
    *,
    epochs: int = 1,
    max_steps: int | None = None,
    class_weight: torch.Tensor | None = None,
    desc: str | None = None,
    train_mode: bool = True,
    pos_weight: torch.Tensor | None = None,
) -> EpochStats:
    """Run local epochs of masked-BCE training (:func:`train_steps` with that loss).

    Args:
        model: the network (its forward returns logits [B, K]).
        loader: yields (images, targets, mask).
        optimizer: the optimiser over the trainable parameters.
        compute: device, precision and memory format (a device: its ``auto`` settings); the
            model is moved to it.
        epochs: number of passes over the loader.
        max_steps: cap on steps per epoch.
        class_weight: optional per-class loss weights [K].
        desc: progress-bar label (None: no bar).
        train_mode: put the model in train mode (False keeps eval mode, e.g. for a frozen backbone).
        pos_weight: optional weight of the positive term per class [K] (with ``class_weight``
            this weighs positives and negatives separately, e.g. a cyclically weighted loss).
    """
    compute = as_compute(compute)
    device = compute.device
    compute.prepare(model).train(train_mode)
    cw = class_weight.to(device) if class_weight is not None else None
    pw = pos_weight.to(device) if pos_weight is not None else None

    def bce(batch: Any) -> torch.Tensor:
        x, y, m = batch
        x = compute.inputs(x)
        y, m = y.to(device, non_blocking=True), m.to(device, non_blocking=True)
        with compute.autocast():
            logits = model(x)
        return masked_bce(logits.float(), y, m, class_weight=cw, pos_weight=pw)

    return train_steps(loader, optimizer, compute, bce, epochs=epochs, max_steps=max_steps, desc=desc)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Batches,
    classes: Sequence[str],
    compute: Compute | torch.device,
    *,
    desc: str | None = None,
) -> EvalResult:
    """Masked BCE and per-class AUROC of a model on one split.

    Args:
        model: the network.
        loader: yields (images, targets, mask) without augmentation.
        classes: the class names of the model's outputs, in order.
        compute: device, precision and memory format (a device: its ``auto`` settings); the
            model is moved to it.
        desc: progress-bar label (None: no bar).
    """
    compute = as_compute(compute)
    compute.prepare(model).eval()
    ys, ms, ps = [], [], []
    total, known = 0.0, 0.0
    for x, y, m in _progress(loader, desc, len(loader)):
        x = compute.inputs(x)
        with compute.autocast():
            logits = model(x).float()
        y, m = y.to(compute.device), m.to(compute.device)
        total += float(masked_bce(logits, y, m, reduction="sum"))
        known += float(m.sum())
        ys.append(y.cpu().numpy())
        ms.append(m.cpu().numpy())
        ps.append(torch.sigmoid(logits).cpu().numpy())
    k = len(classes)
    y_true = np.concatenate(ys) if ys else np.zeros((0, k), np.float32)
    mask = np.concatenate(ms) if ms else np.zeros((0, k), np.float32)
    scores = np.concatenate(ps) if ps else np.zeros((0, k), np.float32)
    loss = total / known if known else math.nan
    return EvalResult(
        loss=loss,
        aurocs=per_class_auroc(y_true, scores, list(classes), mask=mask),
        y_true=y_true,
        mask=mask,
        scores=scores,
        classes=list(classes),
    )


def adam(model: nn.Module, lr: float, weight_decay: float = 0.0) -> torch.optim.Adam:
    """Adam over the model's trainable parameters.

    Args:
        model: the network.
        lr: learning rate.
        weight_decay: weight decay.
    """
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
