"""Cyclical weight transfer (CWT) and its four optimizations, free of any FL framework.

Balachandar, Chang et al., "Accounting for data variability in multi-institutional distributed
deep learning for medical imaging", JAMIA 2020 (``papers/cyclical-weight-transfer-*.txt``).
One model visits the sites in turn; the weights that leave site k are the weights site k+1
starts from. The four optimizations, each switchable in :class:`CWTConfig`:

- proportional local training iterations (PLTI, :func:`plti_steps`): site i trains
  ``s * n_i`` steps (``n_i`` its training images) instead of the same number everywhere, so each
  image is seen equally often. ``s = local_steps * k / N``: the mean over the k sites stays
  ``local_steps`` (same total work as vanilla CWT); by default ``local_steps = N / (k * b)``, so
  ``s = 1 / b`` and one cycle is one epoch over all sites' data, as in the paper.
- cyclical learning rate (CLR, :func:`clr_rates`): ``lr_i = lr * k * n_i / N``; the mean
  over the sites is the global rate ``lr``.
- locally weighted minibatch sampling (LWMS, :func:`lwms_sample_weights`): at site i an image
  with label j is drawn with weight ``1 / n_ij`` (here normalised to ``1 / (L_i * n_ij)``), so
  every label present at the site is equally likely in each minibatch.
- cyclically weighted loss (CWL, :func:`cwl_class_weights`): the loss term of label j at site i
  is weighted ``1 / (L * p_ij)`` with ``p_ij`` its local share (the paper's ``1 / p_ij``, times
  the constant ``1 / L`` so that a balanced site gets weight 1, i.e. the plain loss).

The text of the paper we have lost its typeset equations; the formulas above are the ones its
words define (iterations "proportional to the training sample size", a rate "proportional to
the number of training samples" whose average "is equal to the global learning rate", sample
weights that make "the data from each label equally likely", loss weights inverse to "the
proportion of samples at institution i with label j").

What leaves a site so that this works (counts, never images):

- to the server, once: the number of training images (PLTI and CLR need ``n_i`` and ``N``),
  the number of validation images, and, for the multi-label task, the site's class names (the
  union head is built from them);
- every cycle: the validation loss of the current model and the number of validation labels it
  was computed on (the early-stopping criterion is the pooled validation loss);
- LWMS and CWL use the site's own label counts, which never leave the site.

Unlike surgical aggregation, the whole model (every head row) and, with
``optimizer_state="travel"``, Adam's moment estimates travel from site to site: every site sees
the model the previous site trained, including the rows of classes it does not annotate.

Tasks: ``binary`` (the paper's abnormal vs normal: one output ``Abnormal`` = any finding
positive, 0 = every finding known negative, i.e. NIH ``No Finding``; a site-side label
transform, see :func:`binary_labels`) and ``multilabel`` (a head over the sorted union of the
sites' classes; the classes a site does not annotate are masked out of its loss, so CWT
composes with class-heterogeneous sites).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import pandas as pd
import torch
from monai.data.utils import set_rnd
from torch import nn
from torch.utils.data import Sampler

from cxrfl.data.dataset import make_loader
from cxrfl.data.site import SiteData
from cxrfl.errors import ConfigError
from cxrfl.labels import union_classes
from cxrfl.models import ModelConfig, build_model
from cxrfl.training import EvalResult, adam, evaluate, train_epochs

log = logging.getLogger(__name__)

TASKS = ("binary", "multilabel")
ORDERS = ("fixed", "shuffled")
OPTIMIZER_STATES = ("travel", "reset")
BINARY_CLASS = "Abnormal"
"""The one output of the binary task: any finding (vs every finding negative, NIH ``No Finding``)."""
OPTIMIZER_PREFIX = "__optimizer__."
"""Prefix of Adam's state entries when they travel with the weights (``optimizer_state="travel"``)."""
NO_POSITIVE = "(no positive label)"
"""LWMS group of multi-label images without any positive known class."""


# --------------------------------------------------------------------------- config
@dataclass(frozen=True)
class CWTConfig:
    """Settings of one CWT run (defaults in one place; every optimization off by default).

    Args:
        task: ``binary`` (abnormal vs normal, one output) or ``multilabel`` (union head, masked).
        num_cycles: most cycles (one cycle = one visit of every site).
        order: ``fixed`` (the sites' order as given) or ``shuffled`` (a new seeded order per cycle).
        local_steps: optimiser steps per visit (vanilla) or their mean over the sites (PLTI);
            None: ``round(N / (k * batch_size))``, one epoch over all data per cycle.
        plti: proportional local training iterations.
        clr: cyclical learning rate.
        lwms: locally weighted minibatch sampling.
        cwl: cyclically weighted loss.
        lr: the global Adam learning rate.
        batch_size: minibatch size.
        weight_decay: Adam weight decay (the paper used L2 1e-4).
        optimizer_state: ``travel`` (Adam's moments move with the weights: the relay trains one
            model with one optimiser) or ``reset`` (each visit starts a fresh Adam).
        patience: cycles without improvement of the pooled validation loss before stopping.
        min_delta: smaller improvements do not count.
        augment: random rotation/flip/zoom/contrast on training images.
        seed: seed of the initial weights, the relay order, sampling and augmentation.
        amp: mixed precision on CUDA (ignored on CPU).
    """

    task: str = "binary"
    num_cycles: int = 30
    order: str = "fixed"
    local_steps: int | None = None
    plti: bool = False
    clr: bool = False
    lwms: bool = False
    cwl: bool = False
    lr: float = 1e-3
    batch_size: int = 32
    weight_decay: float = 0.0
    optimizer_state: str = "travel"
    patience: int = 5
    min_delta: float = 1e-4
    augment: bool = True
    seed: int = 0
    amp: bool = True

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"cwt.task must be one of {list(TASKS)}, got {self.task!r}")
        if self.order not in ORDERS:
            raise ConfigError(f"cwt.order must be one of {list(ORDERS)}, got {self.order!r}")
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ConfigError(f"cwt.optimizer_state must be one of {list(OPTIMIZER_STATES)}, got {self.optimizer_state!r}")
        for name in ("num_cycles", "batch_size", "patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(f"cwt.{name} must be an integer >= 1, got {value!r}")
        if self.local_steps is not None and (
            isinstance(self.local_steps, bool) or not isinstance(self.local_steps, (int, np.integer)) or self.local_steps < 1
        ):
            raise ConfigError(f"cwt.local_steps must be an integer >= 1 or null, got {self.local_steps!r}")
        for name in ("plti", "clr", "lwms", "cwl", "augment", "amp"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"cwt.{name} must be true or false, got {getattr(self, name)!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"cwt.lr must be a number > 0, got {self.lr!r}")
        if self.weight_decay < 0 or self.min_delta < 0:
            raise ConfigError("cwt.weight_decay and cwt.min_delta must be >= 0")

    @property
    def method(self) -> str:
        """A label such as ``CWT``, ``CWT+PLTI`` or ``CWT+LWMS+CWL``."""
        parts = [name.upper() for name in ("plti", "clr", "lwms", "cwl") if getattr(self, name)]
        return "+".join(["CWT", *parts])

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (job configs, task metadata, result files)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> CWTConfig:
        """Build from a mapping, rejecting unknown keys.

        Args:
            data: settings (None or missing keys: the defaults).
        """
        data = dict(data or {})
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown cwt setting(s) {sorted(unknown)}; known: {sorted(f.name for f in fields(cls))}")
        return cls(**data)


# --------------------------------------------------------------- the optimizations
def _counts(site_counts: Mapping[str, int]) -> tuple[list[str], np.ndarray]:
    names = list(site_counts)
    n = np.array([site_counts[s] for s in names], dtype=np.float64)
    if not names:
        raise ValueError("no site counts given")
    if (n < 0).any() or not np.isfinite(n).all():
        raise ValueError(f"training sizes must be finite and >= 0, got {dict(site_counts)}")
    if n.sum() <= 0:
        raise ValueError(f"no site has training images: {dict(site_counts)}")
    return names, n


def default_local_steps(site_counts: Mapping[str, int], batch_size: int) -> int:
    """Steps per visit that make one cycle one epoch over all sites: ``round(N / (k * b))`` (>= 1).

    Args:
        site_counts: site -> training images.
        batch_size: minibatch size b.
    """
    names, n = _counts(site_counts)
    return max(1, int(math.floor(n.sum() / (len(names) * batch_size) + 0.5)))


def plti_steps(site_counts: Mapping[str, int], base_steps: int) -> dict[str, int]:
    """Proportional local training iterations: ``steps_i = round(s * n_i)`` with ``s = base_steps * k / N``.

    The paper's "number of iterations proportional to the training sample size" with the scaling
    factor chosen so that the mean over the k sites is ``base_steps``; with ``base_steps = N / (k b)``
    it is the paper's ``s = 1 / b`` (one cycle = one epoch over all data). A site with training
    images gets at least one step; a site without gets none.

    Args:
        site_counts: site -> training images n_i.
        base_steps: the mean steps per visit (vanilla CWT's fixed number).
    """
    if base_steps < 1:
        raise ValueError(f"base_steps must be >= 1, got {base_steps}")
    names, n = _counts(site_counts)
    scale = base_steps * len(names) / n.sum()
    return {s: (max(1, int(math.floor(scale * ni + 0.5))) if ni > 0 else 0) for s, ni in zip(names, n)}


def clr_rates(site_counts: Mapping[str, int], global_lr: float) -> dict[str, float]:
    """Cyclical learning rate: ``lr_i = global_lr * k * n_i / N`` (mean over the k sites = ``global_lr``).

    Args:
        site_counts: site -> training images n_i.
        global_lr: the global learning rate.
    """
    if not global_lr > 0:
        raise ValueError(f"global_lr must be > 0, got {global_lr}")
    names, n = _counts(site_counts)
    return {s: float(global_lr * (len(names) * ni / n.sum())) for s, ni in zip(names, n)}


def _targets_mask(targets: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(targets, dtype=np.float64)
    if t.ndim == 1:
        t = t[:, None]
    if t.ndim != 2:
        raise ValueError(f"targets must be [n] or [n, K], got shape {t.shape}")
    m = ~np.isnan(t) if mask is None else np.asarray(mask).reshape(t.shape) != 0
    t = np.where(m, np.nan_to_num(t), 0.0)
    if not np.isin(t[m], (0.0, 1.0)).all():
        raise ValueError("known labels must be 0 or 1")
    return t, m


def label_groups(targets: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """The label each image counts for in LWMS.

    One output (the binary task): the label itself (0 or 1). Several outputs: the image's rarest
    known positive class at this site (column index), or ``K`` (no positive label) — the
    multi-label reading of "each label equally likely". Images without any known label get -1
    (never sampled).

    Args:
        targets: [n] or [n, K] labels (NaN = unknown when ``mask`` is None).
        mask: [n, K], nonzero where the label is known.
    """
    t, m = _targets_mask(targets, mask)
    n, k = t.shape
    known_any = m.any(axis=1)
    if k == 1:
        return np.where(known_any, t[:, 0], -1).astype(np.int64)
    positives = (t * m).sum(axis=0)
    rarity = np.where((t > 0) & m, positives[None, :], np.inf)
    groups = np.where(np.isfinite(rarity.min(axis=1)), rarity.argmin(axis=1), k)
    return np.where(known_any, groups, -1).astype(np.int64)


def lwms_sample_weights(targets: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Locally weighted minibatch sampling: weight ``1 / (L * n_j)`` for an image of label j.

    ``n_j`` is the number of the site's images with label j (see :func:`label_groups`) and L the
    number of labels present at the site, so the weights sum to 1 and each present label has
    probability 1/L per draw (use with ``torch.utils.data.WeightedRandomSampler`` or
    :class:`VisitSampler`). The paper's weight is ``1 / n_ij``; the constant does not change sampling.

    Args:
        targets: [n] or [n, K] labels.
        mask: [n, K] known-label mask (default: not NaN).
    """
    groups = label_groups(targets, mask)
    present, counts = np.unique(groups[groups >= 0], return_counts=True)
    weights = np.zeros(len(groups), dtype=np.float64)
    for g, c in zip(present, counts):
        weights[groups == g] = 1.0 / (len(present) * c)
    return weights


def cwl_class_weights(positives: Sequence[float], known: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Cyclically weighted loss: per class, the weights of its positive and negative terms.

    For an output c with positive share ``p = positives / known`` at the site, the two labels
    (positive, negative) are weighted ``1 / (2 p)`` and ``1 / (2 (1 - p))`` — the paper's
    ``1 / p_ij`` for the L = 2 labels of a binary cross-entropy, times 1/L so that a balanced site
    gets weight 1 and the mean weight over the site's images is 1. A class with only one label
    value at the site (or no known label) keeps weight 1 for both terms (see :func:`label_warnings`).

    Args:
        positives: [K] positive images per class at the site.
        known: [K] images with a known label per class at the site.

    Returns:
        (w_pos, w_neg), each [K].
    """
    pos = np.asarray(positives, dtype=np.float64)
    n = np.asarray(known, dtype=np.float64)
    if pos.shape != n.shape or (pos < 0).any() or (pos > n).any():
        raise ValueError(f"need 0 <= positives <= known per class, got {pos.tolist()} / {n.tolist()}")
    w_pos, w_neg = np.ones_like(pos), np.ones_like(pos)
    ok = (pos > 0) & (pos < n)
    p = np.where(ok, pos / np.where(n > 0, n, 1.0), 0.5)
    w_pos[ok] = 1.0 / (2.0 * p[ok])
    w_neg[ok] = 1.0 / (2.0 * (1.0 - p[ok]))
    return w_pos, w_neg


def cwl_loss_weights(positives: Sequence[float], known: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cwl_class_weights` as ``(pos_weight, class_weight)`` for :func:`cxrfl.losses.masked_bce`.

    ``class_weight * BCE(pos_weight)`` = ``w_pos * y * (-log p) + w_neg * (1 - y) * (-log(1 - p))``.

    Args:
        positives: [K] positive images per class.
        known: [K] images with a known label per class.
    """
    w_pos, w_neg = cwl_class_weights(positives, known)
    return torch.as_tensor(w_pos / w_neg, dtype=torch.float32), torch.as_tensor(w_neg, dtype=torch.float32)


def label_warnings(
    site: str, classes: Sequence[str], positives: Sequence[float], known: Sequence[float], *, lwms: bool, cwl: bool
) -> list[str]:
    """Clear warnings for classes with one label value only at a site, when LWMS or CWL is on.

    Args:
        site: the site name (for the message).
        classes: the output classes.
        positives: [K] positive images per class at the site.
        known: [K] images with a known label per class at the site.
        lwms: LWMS is on.
        cwl: CWL is on.
    """
    if not (lwms or cwl):
        return []
    which = " and ".join(name for name, on in (("LWMS", lwms), ("CWL", cwl)) if on)
    out = []
    for only, test in (("negative", lambda p, n: p == 0), ("positive", lambda p, n: p == n)):
        names = [f"{c!r} ({int(p)} positive of {int(n)})" for c, p, n in zip(classes, positives, known) if n > 0 and test(p, n)]
        if names:  # classes without known labels here are masked out: nothing to balance
            what = []
            if lwms:
                what.append("LWMS: no minibatch share for the missing label")
            if cwl:
                what.append(f"CWL: the loss of {'that class' if len(names) == 1 else 'those classes'} stays unweighted")
            out.append(
                f"site {site}: only {only} training images for class(es) {', '.join(names)}: one label only, so "
                f"{which} cannot balance {'it' if len(names) == 1 else 'them'} here ({'; '.join(what)}). "
                f"The site still trains on what it has."
            )
    return out


# ----------------------------------------------------------------------- the relay
@dataclass(frozen=True)
class Visit:
    """What a site does with the model on its turn.

    Args:
        steps: optimiser steps.
        lr: learning rate.
    """

    steps: int
    lr: float


def relay_plan(site_counts: Mapping[str, int], config: CWTConfig) -> dict[str, Visit]:
    """Steps and learning rate per site, from the sites' training sizes only.

    Args:
        site_counts: site -> training images (sites without images are left out).
        config: the run's settings.
    """
    counts = {s: int(n) for s, n in site_counts.items() if n > 0}
    base = config.local_steps or default_local_steps(counts, config.batch_size)
    steps = plti_steps(counts, base) if config.plti else {s: base for s in counts}
    rates = clr_rates(counts, config.lr) if config.clr else {s: float(config.lr) for s in counts}
    return {s: Visit(steps[s], rates[s]) for s in counts}


def relay_order(sites: Sequence[str], cycle: int, order: str, seed: int) -> list[str]:
    """The visiting order of one cycle.

    Args:
        sites: the sites in their fixed order.
        cycle: the cycle number (1-based).
        order: ``fixed`` (as given, every cycle) or ``shuffled`` (a permutation drawn from
            ``seed`` and ``cycle``: the same on every rerun).
        seed: the run's seed.
    """
    if order == "fixed":
        return list(sites)
    if order == "shuffled":
        rng = np.random.default_rng([int(seed), int(cycle)])
        return [sites[i] for i in rng.permutation(len(sites))]
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def visit_seed(seed: int, cycle: int, site: str) -> int:
    """A seed for one visit (sampling, augmentation, dropout), stable across processes.

    Args:
        seed: the run's seed.
        cycle: the cycle number.
        site: the site name.
    """
    return (int(seed) * 1_000_003 + int(cycle) * 10_007 + zlib.crc32(site.encode())) % (2**31 - 1)


# ------------------------------------------------------------------------- labels
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


# ----------------------------------------------------------------- optimizer state
def params_digest(params: Mapping[str, Any]) -> str:
    """SHA-256 of a parameter dict (names, dtypes, shapes and bytes, in sorted name order).

    Args:
        params: name -> tensor or array.
    """
    h = hashlib.sha256()
    for k in sorted(params):
        v = params[k]
        a = np.ascontiguousarray(v.detach().cpu().numpy() if torch.is_tensor(v) else np.asarray(v))
        h.update(k.encode())
        h.update(str(a.dtype).encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def optimizer_arrays(optimizer: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Adam's per-parameter state as flat numpy arrays (``__optimizer__.<index>.<name>``).

    Args:
        optimizer: the optimiser (one parameter group).
    """
    out = {}
    for idx, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            out[f"{OPTIMIZER_PREFIX}{idx}.{name}"] = (
                value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)
            )
    return out


def load_optimizer_arrays(optimizer: torch.optim.Optimizer, arrays: Mapping[str, Any]) -> None:
    """Load state written by :func:`optimizer_arrays` (learning rates stay as set on the optimiser).

    Args:
        optimizer: an optimiser over the same parameters in the same order.
        arrays: ``__optimizer__.<index>.<name>`` -> array.
    """
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in arrays.items():
        idx, _, name = key.removeprefix(OPTIMIZER_PREFIX).partition(".")
        state.setdefault(int(idx), {})[name] = torch.as_tensor(np.asarray(value))
    if not state:
        return
    sd = optimizer.state_dict()
    n_params = sum(len(g["params"]) for g in sd["param_groups"])
    if max(state) >= n_params:
        raise ValueError(f"optimizer state names parameter {max(state)}, the model has {n_params}")
    sd["state"] = state
    optimizer.load_state_dict(sd)


def split_params(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model weights, optimiser state entries) of a travelling payload.

    Args:
        params: name -> array.
    """
    model = {k: v for k, v in params.items() if not k.startswith(OPTIMIZER_PREFIX)}
    opt = {k: v for k, v in params.items() if k.startswith(OPTIMIZER_PREFIX)}
    return model, opt


# ---------------------------------------------------------------------- the site
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
        if self.weights is not None and (len(self.weights) != self.n or not (self.weights.sum() > 0) or (self.weights < 0).any()):
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
            return iter(torch.multinomial(self.weights, self.num_samples, replacement=True, generator=self.generator).tolist())
        passes = [torch.randperm(self.n, generator=self.generator) for _ in range(-(-self.num_samples // self.n))]
        return iter(torch.cat(passes)[: self.num_samples].tolist())


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
        table, self.own_classes = task_table(data, config.task)
        self.classes = list(classes) if classes is not None else list(self.own_classes)
        missing = sorted(set(self.own_classes) - set(self.classes))
        if missing:
            raise ConfigError(f"site {self.name}: the model does not predict its classes {missing}")
        self.tables = {s: _on_classes(table[table["split"] == s], self.classes) for s in ("train", "val", "test")}
        self._labels = self.tables["train"][self.classes].to_numpy(dtype=np.float64)
        self.positives = (self._labels == 1.0).sum(axis=0).astype(np.int64)
        self.known = (~np.isnan(self._labels)).sum(axis=0).astype(np.int64)
        self._loaders: dict[tuple, torch.utils.data.DataLoader] = {}
        self.configure(config)

    def configure(self, config: CWTConfig) -> None:
        """Switch the run's settings (optimizations) without reading the images again.

        Args:
            config: the new settings (same task).
        """
        if config.task != self.config.task:
            raise ConfigError(f"site {self.name}: cannot switch the task of a built site ({self.config.task} -> {config.task})")
        self.config = config
        self.warnings = label_warnings(self.name, self.classes, self.positives, self.known, lwms=config.lwms, cwl=config.cwl)
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

    def loader(self, split: str) -> torch.utils.data.DataLoader:
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
                self.tables[split], self.classes, image_size=self.model_config.image_size, train=train and c.augment,
                batch_size=c.batch_size, num_workers=self.num_workers, seed=c.seed, cache=True, sampler=sampler,
                in_channels=self.model_config.in_channels,
            )
        loader = self._loaders[key]
        if train:
            loader.sampler.set_weights(self.sample_weights)
        return loader

    def train_visit(self, model: nn.Module, optimizer: torch.optim.Optimizer, visit: Visit, cycle: int) -> dict[str, Any]:
        """Train the received model in place for this site's turn.

        Args:
            model: the model as received (its weights are what the previous site returned).
            optimizer: Adam over ``model``'s parameters (travelling or fresh state).
            visit: steps and learning rate of this site.
            cycle: the cycle number (seeds sampling and augmentation).
        """
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = visit.lr
        loader = self.loader("train")
        seed = visit_seed(self.config.seed, cycle, self.name)
        loader.sampler.start_visit(visit.steps * self.config.batch_size, seed)
        set_rnd(loader.dataset, seed)
        torch.manual_seed(seed)
        pos_weight, class_weight = self.loss_weights
        stats = train_epochs(
            model, loader, optimizer, self.device, epochs=1, max_steps=visit.steps, class_weight=class_weight,
            pos_weight=pos_weight, amp=self.config.amp,
        )
        return {"site": self.name, "cycle": cycle, "steps": stats.steps, "lr": visit.lr, "train_loss": stats.loss,
                "images": stats.images, "seconds": time.perf_counter() - start}

    def evaluate(self, model: nn.Module, split: str = "val") -> EvalResult:
        """Evaluate a model on one split of this site.

        Args:
            model: the network.
            split: ``val`` or ``test``.
        """
        return evaluate(model, self.loader(split), self.classes, self.device, amp=self.config.amp)


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
    return {"loss": result.loss, "n": int(len(result.y_true)), "n_known": int(result.mask.sum()),
            "accuracy": accuracy(result), "auroc": result.aurocs, "mean_auroc": result.mean_auroc}


def pooled_loss(parts: Sequence[tuple[float, float]]) -> float:
    """The loss over the union of several sets from (mean loss, number of known labels) per set.

    Args:
        parts: (loss, n_known) per site; NaN losses and empty sets are left out.
    """
    good = [(loss, n) for loss, n in parts if n > 0 and math.isfinite(loss)]
    total = sum(n for _, n in good)
    return sum(loss * n for loss, n in good) / total if total else math.nan


# --------------------------------------------------------------- in-process relay
@dataclass
class CWTResult:
    """Outcome of :func:`run_cwt`.

    Args:
        model: the network with the best cycle's weights.
        classes: its outputs.
        best_cycle: the cycle with the lowest pooled validation loss (0: no cycle had a finite
            loss; the model is then the initial one).
        best_val_loss: that loss.
        plan: site -> (steps, lr) per visit.
        history: one record per cycle (order, visits, pooled validation loss).
        stopped_early: early stopping ended the run.
        seconds: wall time.
    """

    model: nn.Module
    classes: list[str]
    best_cycle: int
    best_val_loss: float
    plan: dict[str, Visit]
    history: list[dict[str, Any]] = field(default_factory=list)
    stopped_early: bool = False
    seconds: float = 0.0


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


def run_cwt(
    sites: Sequence[CWTSite],
    model_config: ModelConfig,
    config: CWTConfig,
    *,
    device: torch.device | None = None,
    available: Callable[[str, int], bool] | None = None,
    logger: logging.Logger | None = None,
) -> CWTResult:
    """Cyclical weight transfer in one process (plain PyTorch; the benchmark's engine).

    Every cycle the model visits the sites in :func:`relay_order`; each trains it in place for
    its :func:`relay_plan` steps at its rate; after the cycle the pooled validation loss over all
    sites decides early stopping, and the best cycle's weights are kept (the untrained initial
    model is never chosen, as NVFlare's model selectors skip round 0). Central hosting is
    ``run_cwt`` over one site holding all the data.

    Args:
        sites: the sites (same ``classes``), in fixed relay order.
        model_config: the network.
        config: the run's settings (``sites`` must have been built with the same).
        device: torch device (default: the sites').
        available: ``(site, cycle) -> bool``; a site that is not available is skipped for that
            turn (with a log line) and the model goes on to the next site unchanged.
        logger: where to log (default: this module's logger).
    """
    logger = logger or log
    start = time.perf_counter()
    if not sites:
        raise ValueError("run_cwt needs at least one site")
    classes = sites[0].classes
    if any(s.classes != classes for s in sites):
        raise ValueError("all sites must be built with the same classes (see make_sites)")
    device = device or sites[0].device
    for s in sites:
        for w in s.warnings:
            logger.warning(w)
    plan = relay_plan({s.name: s.num_train for s in sites}, config)
    relay = [s for s in sites if s.name in plan]
    torch.manual_seed(config.seed)
    model = build_model(model_config, len(classes)).to(device)
    optimizer = adam(model, config.lr, config.weight_decay)

    def val_loss() -> float:
        return pooled_loss([(r.loss, float(r.mask.sum())) for r in (s.evaluate(model, "val") for s in relay)])

    best_loss, best_cycle = math.inf, 0
    best_state = copy.deepcopy(model.state_dict())
    history: list[dict[str, Any]] = []
    stale, stopped = 0, False
    by_name = {s.name: s for s in relay}
    for cycle in range(1, config.num_cycles + 1):
        order = relay_order([s.name for s in relay], cycle, config.order, config.seed)
        visits = []
        for name in order:
            if available is not None and not available(name, cycle):
                logger.warning("cycle %d: site %s is not available; skipped, the model goes on unchanged", cycle, name)
                visits.append({"site": name, "cycle": cycle, "skipped": True})
                continue
            if config.optimizer_state == "reset":
                optimizer = adam(model, config.lr, config.weight_decay)
            visits.append(by_name[name].train_visit(model, optimizer, plan[name], cycle))
        loss = val_loss()
        history.append({"cycle": cycle, "order": order, "visits": visits, "val_loss": loss})
        logger.info("cycle %d (%s): pooled val loss %.4f", cycle, " > ".join(order), loss)
        if math.isfinite(loss) and (best_cycle == 0 or loss < best_loss - config.min_delta):
            best_loss, best_cycle, stale = loss, cycle, 0
            best_state = copy.deepcopy(model.state_dict())
        else:
            stale += 1
            if stale >= config.patience:
                stopped = True
                logger.info("early stop after cycle %d (best cycle %d)", cycle, best_cycle)
                break
    model.load_state_dict(best_state)
    return CWTResult(model=model, classes=list(classes), best_cycle=best_cycle, best_val_loss=best_loss, plan=plan,
                     history=history, stopped_early=stopped, seconds=time.perf_counter() - start)
