"""Settings of a CWT run: one frozen dataclass, defaults in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from cxrfl.common.config import Config

TASKS = ("binary", "multilabel")
ORDERS = ("fixed", "shuffled")
OPTIMIZER_STATES = ("travel", "reset")
BINARY_CLASS = "Abnormal"
"""The one output of the binary task: any finding (vs every finding negative, NIH ``No Finding``)."""
OPTIMIZER_PREFIX = "__optimizer__."
"""Prefix of Adam's state entries when they travel with the weights (``optimizer_state="travel"``)."""


@dataclass(frozen=True)
class CWTConfig(Config):
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

    SECTION: ClassVar[str] = "cwt"
    task: str = field(default="binary", metadata={"choices": TASKS})
    num_cycles: int = field(default=30, metadata={"ge": 1})
    order: str = field(default="fixed", metadata={"choices": ORDERS})
    local_steps: int | None = field(default=None, metadata={"ge": 1})
    plti: bool = False
    clr: bool = False
    lwms: bool = False
    cwl: bool = False
    lr: float = field(default=1e-3, metadata={"gt": 0})
    batch_size: int = field(default=32, metadata={"ge": 1})
    weight_decay: float = field(default=0.0, metadata={"ge": 0})
    optimizer_state: str = field(default="travel", metadata={"choices": OPTIMIZER_STATES})
    patience: int = field(default=5, metadata={"ge": 1})
    min_delta: float = field(default=1e-4, metadata={"ge": 0})
    augment: bool = True
    seed: int = 0
    amp: bool = True

    @property
    def method(self) -> str:
        """A label such as ``CWT``, ``CWT+PLTI`` or ``CWT+LWMS+CWL``."""
        parts = [name.upper() for name in ("plti", "clr", "lwms", "cwl") if getattr(self, name)]
        return "+".join(["CWT", *parts])
