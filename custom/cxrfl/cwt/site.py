"""One site of the relay: its data in the task's form, its label counts, its local training."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import pandas as pd
import torch
from monai.data.utils import set_rnd
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Sampler

from cxrfl.cwt.config import BINARY_CLASS, TASKS, CWTConfig
from cxrfl.cwt.optimizations import cwl_loss_weights, label_warnings, lwms_sample_weights
from cxrfl.cwt.relay import Visit, lr_factor, visit_seed
from cxrfl.data.dataset import DeviceLoader, make_loader
from cxrfl.data.labels import union_classes
from cxrfl.data.site import SiteData
from cxrfl.errors import ConfigError
from cxrfl.nn.models import ModelConfig
from cxrfl.nn.precision import compute_for
from cxrfl.nn.training import EvalResult, evaluate, train_epochs


def binary_labels(table: pd.DataFrame, classes: Sequence[str]) -> pd.Series:
    """The binary task's label: 1 if any finding is positive, 0 if every finding is known negative.

    On NIH, CheXpert and MIMIC-CXR (a full finding list per image) 0 is "No Finding". An image
    with no positive and some unknown finding is unknown (NaN, masked). A site that annotates only
    a few findings calls "normal" what is only "none of its findings": give the binary task sites
    with complete finding lists.

    Args:
        table: rows with the class columns (1.0, 0.0 or NaN).
        classes: the finding columns.
    """
    values = table[list(classes)].to_numpy(dtype=np.float64)
    positive = (values == 1.0).any(axis=1)
    all_known = ~np.isnan(values).any(axis=1)
    out = np.where(positive, 1.0, np.where(all_known, 0.0, np.nan))
    return pd.Series(out, index=table.index, name=BINARY_CLASS)


def task_table(data: SiteData, task: str) -> tuple[pd.DataFrame, list[str]]:
    """A site's table for the task and the classes it labels.

    Args:
        data: the site's data.
        task: ``binary`` or ``multilabel``.
    """
    if task == "binary":
        table = data.table[["path", "patient", "split"]].copy()
        table[BINARY_CLASS] = binary_labels(data.table, data.classes)
        return table, [BINARY_CLASS]
    if task == "multilabel":
        return data.table, list(data.classes)
    raise ConfigError(f"task must be one of {list(TASKS)}, got {task!r}")


def global_classes(task: str, announced: Mapping[str, Sequence[str]] | Sequence[Sequence[str]]) -> list[str]:
    """The model's outputs: ``[Abnormal]`` (binary) or the sorted union of the sites' classes.

    Args:
        task: ``binary`` or ``multilabel``.
        announced: each site's class names.
    """
    if task == "binary":
        return [BINARY_CLASS]
    lists = announced.values() if isinstance(announced, Mapping) else announced
    return union_classes(*lists)


def _on_classes(table: pd.DataFrame, classes: Sequence[str]) -> pd.DataFrame:
    """``path``, ``patient`` and the model's class columns (NaN where the site has no such column)."""
    frame = table[["path", "patient"]].reset_index(drop=True).copy()
    for c in classes:
        frame[c] = table[c].to_numpy(dtype=np.float64) if c in table else np.nan
    return frame


class VisitSampler(Sampler[int]):
    """Indices of one visit: ``num_samples`` draws, reseeded for every visit.

    Without weights: shuffled passes over the site's images (each image once per pass, as
    epochs). With weights (LWMS): draws with replacement in proportion to the weights.

    Args:
        n: number of images.
        weights: [n] sampling weights, or None.
    """

    def __init__(self, n: int, weights: np.ndarray | None = None) -> None:
        self.n = int(n)
        self.set_weights(weights)
        self.num_samples = 0
        self.generator = torch.Generator()

    def set_weights(self, weights: np.ndarray | None) -> None:
        """Switch between shuffled passes (None) and weighted draws.

        Args:
            weights: [n] non-negative sampling weights with a positive sum, or None.
        """
        self.weights = None if weights is None else torch.as_tensor(np.asarray(weights), dtype=torch.float64)
        if self.weights is not None and (
            len(self.weights) != self.n or not (self.weights.sum() > 0) or (self.weights < 0).any()
        ):
            raise ValueError("weights must have one non-negative entry per image and a positive sum")

    def start_visit(self, num_samples: int, seed: int) -> None:
        """Set the draws and the seed of the next iteration.

        Args:
            num_samples: indices to yield (steps x batch size).
            seed: the visit's seed.
        """
        self.num_samples = int(num_samples)
        self.generator.manual_seed(int(seed))

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        if self.n == 0 or self.num_samples == 0:
            return iter(())
        if self.weights is not None:
            return iter(
                torch.multinomial(self.weights, self.num_samples, replacement=True, generator=self.generator).tolist()
            )
        passes = [torch.randperm(self.n, generator=self.generator) for _ in range(-(-self.num_samples // self.n))]
        return iter(torch.cat(passes)[: self.num_samples].tolist())


def _visit_sampler(loader: DataLoader | DeviceLoader) -> VisitSampler:
    """A training loader's sampler: :meth:`CWTSite.loader` gives it a :class:`VisitSampler`."""
    return cast(VisitSampler, loader.sampler)


class CWTSite:
    """One site of the relay: its data in the task's form, its label counts, its local training.

    Args:
        data: the site's loaded data.
        config: the run's settings.
        model_config: the network (image size, channels).
        classes: the model's outputs (default: the site's own, see :func:`global_classes`).
        device: torch device.
        num_workers: data-loader worker processes.
    """

    def __init__(
        self,
        data: SiteData,
        config: CWTConfig,
        model_config: ModelConfig,
        *,
        classes: Sequence[str] | None = None,
        device: torch.device | None = None,
        num_workers: int = 0,
    ) -> None:
        self.name = data.site
        self.config = config
        self.model_config = model_config
        self.device = device or torch.device("cpu")
        self.num_workers = num_workers
        self.cache_dir = data.cache_dir
        table, self.own_classes = task_table(data, config.task)
        self.classes = list(classes) if classes is not None else list(self.own_classes)
        missing = sorted(set(self.own_classes) - set(self.classes))
        if missing:
            raise ConfigError(f"site {self.name}: the model does not predict its classes {missing}")
        self.tables = {s: _on_classes(table[table["split"] == s], self.classes) for s in ("train", "val", "test")}
        self._labels = self.tables["train"][self.classes].to_numpy(dtype=np.float64)
        self.positives = (self._labels == 1.0).sum(axis=0).astype(np.int64)
        self.known = (~np.isnan(self._labels)).sum(axis=0).astype(np.int64)
        self._loaders: dict[tuple, DataLoader | DeviceLoader] = {}
        self.configure(config)

    def configure(self, config: CWTConfig) -> None:
        """Switch the run's settings (optimizations) without reading the images again.

        Args:
            config: the new settings (same task).
        """
        if config.task != self.config.task:
            raise ConfigError(
                f"site {self.name}: cannot switch the task of a built site ({self.config.task} -> {config.task})"
            )
        self.config = config
        self.compute = compute_for(config, self.device)
        self.warnings = label_warnings(
            self.name, self.classes, self.positives, self.known, lwms=config.lwms, cwl=config.cwl
        )
        weights = lwms_sample_weights(self._labels) if config.lwms else None
        self.sample_weights = weights if weights is not None and weights.sum() > 0 else None
        self.loss_weights = cwl_loss_weights(self.positives, self.known) if config.cwl else (None, None)

    @property
    def num_train(self) -> int:
        return len(self.tables["train"])

    @property
    def num_val(self) -> int:
        return len(self.tables["val"])

    def counts(self) -> dict[str, Any]:
        """What this site tells the server before the relay starts (counts only, no labels per image).

        ``classes`` only in the multi-label task (the union head is built from them).
        """
        out: dict[str, Any] = {"n_train": self.num_train, "n_val": self.num_val}
        if self.config.task == "multilabel":
            out["classes"] = list(self.own_classes)
        return out

    def loader(self, split: str) -> DataLoader | DeviceLoader:
        """The site's loader of one split, built once (training: :class:`VisitSampler`; images cached).

        Args:
            split: ``train``, ``val`` or ``test``.
        """
        c = self.config
        train = split == "train"
        key = (split, c.batch_size, train and c.augment)
        if key not in self._loaders:
            sampler = VisitSampler(len(self.tables[split])) if train else None
            self._loaders[key] = make_loader(
                self.tables[split],
                self.classes,
                image_size=self.model_config.image_size,
                train=train and c.augment,
                batch_size=c.batch_size,
                num_workers=self.num_workers,
                seed=c.seed,
                cache=True,
                sampler=sampler,
                in_channels=self.model_config.in_channels,
                cache_dir=self.cache_dir,
                device=self.device,
            )
        loader = self._loaders[key]
        if train:
            _visit_sampler(loader).set_weights(self.sample_weights)
        return loader

    def train_visit(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, visit: Visit, cycle: int
    ) -> dict[str, Any]:
        """Train the received model in place for this site's turn.

        The learning rate of each step is ``visit.lr`` times the decay factor of the relay's
        iteration count (:func:`cxrfl.cwt.relay.lr_factor`), which starts at ``visit.iteration``.

        Args:
            model: the model as received (its weights are what the previous site returned).
            optimizer: Adam over ``model``'s parameters (travelling or fresh state).
            visit: steps, learning rate and starting iteration of this site's turn.
            cycle: the cycle number (seeds sampling and augmentation).
        """
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = visit.lr
            group.pop("initial_lr", None)
        schedule = LambdaLR(optimizer, lambda t: lr_factor(visit.iteration + t, self.config))
        first_lr = optimizer.param_groups[0]["lr"]
        hook = optimizer.register_step_post_hook(lambda *_: schedule.step())
        loader = self.loader("train")
        seed = visit_seed(self.config.seed, cycle, self.name)
        _visit_sampler(loader).start_visit(visit.steps * self.config.batch_size, seed)
        set_rnd(loader.dataset, seed)
        torch.manual_seed(seed)
        pos_weight, class_weight = self.loss_weights
        try:
            stats = train_epochs(
                model,
                loader,
                optimizer,
                self.compute,
                epochs=1,
                max_steps=visit.steps,
                class_weight=class_weight,
                pos_weight=pos_weight,
            )
        finally:
            hook.remove()
        return {
            "site": self.name,
            "cycle": cycle,
            "steps": stats.steps,
            "lr": first_lr,
            "iteration": visit.iteration,
            "train_loss": stats.loss,
            "images": stats.images,
            "seconds": time.perf_counter() - start,
        }

    def evaluate(self, model: nn.Module, split: str = "val") -> EvalResult:
        """Evaluate a model on one split of this site.

        Args:
            model: the network.
            split: ``val`` or ``test``.
        """
        return evaluate(model, self.loader(split), self.classes, self.compute)


def accuracy(result: EvalResult, threshold: float = 0.5) -> float | None:
    """Share of known labels predicted right at ``threshold`` (binary task: the usual accuracy).

    Args:
        result: an evaluation.
        threshold: probability threshold.
    """
    known = result.mask != 0
    if not known.any():
        return None
    right = (result.scores >= threshold) == (result.y_true >= 0.5)
    return float(right[known].mean())


def eval_summary(result: EvalResult) -> dict[str, Any]:
    """Loss, number of known labels, accuracy, per-class and mean AUROC of one evaluation.

    Args:
        result: an evaluation.
    """
    return {
        "loss": result.loss,
        "n": int(len(result.y_true)),
        "n_known": int(result.mask.sum()),
        "accuracy": accuracy(result),
        "auroc": result.aurocs,
        "mean_auroc": result.mean_auroc,
    }


def pooled_loss(parts: Sequence[tuple[float, float]]) -> float:
    """The loss over the union of several sets from (mean loss, number of known labels) per set.

    Args:
        parts: (loss, n_known) per site; NaN losses and empty sets are left out.
    """
    good = [(loss, n) for loss, n in parts if n > 0 and math.isfinite(loss)]
    total = sum(n for _, n in good)
    return sum(loss * n for loss, n in good) / total if total else math.nan


def make_sites(
    datas: Sequence[SiteData], config: CWTConfig, model_config: ModelConfig, *, device: torch.device | None = None
) -> list[CWTSite]:
    """CWT sites over several sites' data, with the task's global classes.

    Args:
        datas: each site's data, in relay order.
        config: the run's settings.
        model_config: the network.
        device: torch device.
    """
    own = [task_table(d, config.task)[1] for d in datas]
    classes = global_classes(config.task, own)
    return [CWTSite(d, config, model_config, classes=classes, device=device) for d in datas]
