"""The relay: each site's steps and rate, the visiting order, and what travels with the weights."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cxrfl.cwt.config import OPTIMIZER_PREFIX, ORDERS, CWTConfig
from cxrfl.cwt.optimizations import clr_rates, default_local_steps, plti_steps

COUNTS_TASK = "counts"
"""Each site's training and validation sizes (and, multi-label, its class names)."""
TRAIN_TASK = "train"
"""One site's turn: train the travelling model."""
VALIDATE_TASK = "validate"
"""Loss and metrics of a model on a site's validation (or test) split."""
TASKS = (COUNTS_TASK, TRAIN_TASK, VALIDATE_TASK)


@dataclass(frozen=True)
class Visit:
    """What a site does with the model on its turn.

    Args:
        steps: optimiser steps.
        lr: the site's learning rate before decay (the global rate, or CLR's rate).
        iteration: the relay's iteration count when the visit starts (the decay schedule
            continues from it, see :func:`lr_factor`).
    """

    steps: int
    lr: float
    iteration: int = 0


def lr_factor(iteration: int, config: CWTConfig) -> float:
    """The paper's staircase decay: ``lr_decay ** (iteration // lr_decay_every)``.

    Args:
        iteration: optimiser steps taken by the relay so far (over every visit).
        config: the run's settings.
    """
    return float(config.lr_decay ** (int(iteration) // config.lr_decay_every))


def relay_sites(sites: Sequence[str], site_order: Sequence[str] | None) -> list[str]:
    """The fixed relay order: the sites ``site_order`` lists, in its order, then the others by name.

    Args:
        sites: the sites taking part.
        site_order: the preferred order (None: by name).
    """
    rank = {s: i for i, s in enumerate(site_order or ())}
    return sorted(sites, key=lambda s: (rank.get(s, len(rank)), s))


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


def optimizer_arrays(optimizer: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Adam's per-parameter state as C-contiguous numpy arrays (``__optimizer__.<index>.<name>``;
    the moments of channels-last weights leave in row-major order).

    Args:
        optimizer: the optimiser (one parameter group).
    """
    out = {}
    for idx, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            out[f"{OPTIMIZER_PREFIX}{idx}.{name}"] = (
                value.detach().cpu().contiguous().numpy() if torch.is_tensor(value) else np.asarray(value)
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
