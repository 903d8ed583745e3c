"""Settings of a CWT run: what the model and the sites do (:class:`CWTConfig`) and how the server
copes with sites that fail (:class:`RelayConfig`); defaults in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from cxrfl.clinical.pooling import PooledEvaluation
from cxrfl.common.config import Config
from cxrfl.nn.precision import LEGACY_AMP, channels_last_field, precision_field

TASKS = ("binary", "multilabel")
ORDERS = ("fixed", "shuffled")
OPTIMIZER_STATES = ("travel", "reset")
BINARY_CLASS = "Abnormal"
"""The one output of the binary task: any finding (vs every finding negative, NIH ``No Finding``)."""
OPTIMIZER_PREFIX = "__optimizer__."
"""Prefix of Adam's state entries when they travel with the weights (``optimizer_state="travel"``)."""


@dataclass(frozen=True)
class CWTConfig(Config):
    """Settings of one CWT run (every optimization off by default; the base recipe is the paper's).

    The paper's base recipe (Balachandar et al. 2020, "Deep learning models"): Adam, "an
    exponential learning rate decay with a decay rate of 0.99 every 200 training iterations",
    and "cross-entropy loss with an L2 regularization coefficient of 0.0001". Here the decay is
    a staircase over the relay's global iteration count: the rate of iteration t (counted over
    all visits since the start, so a site goes on where the previous one stopped) is
    ``rate * lr_decay ** (t // lr_decay_every)``, where ``rate`` is ``lr`` or, with CLR, the
    site's ``lr * k * n_i / N``. The L2 term is Adam's (coupled) ``weight_decay``: it adds
    ``weight_decay * w`` to every gradient, the gradient of ``weight_decay / 2 * ||w||^2`` added
    to the loss (the ``tf.nn.l2_loss`` convention of the paper's TensorFlow era), over every
    trainable parameter.

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
        lr: the global Adam learning rate (before decay).
        lr_decay: factor applied to the rate every ``lr_decay_every`` iterations (1: no decay;
            the paper: 0.99).
        lr_decay_every: iterations between two decays, counted across visits (the paper: 200).
        batch_size: minibatch size.
        weight_decay: L2 coefficient, Adam's ``weight_decay`` (the paper: 1e-4).
        optimizer_state: ``travel`` (Adam's moments move with the weights: the relay trains one
            model with one optimiser) or ``reset`` (each visit starts a fresh Adam).
        patience: cycles without improvement of the pooled validation loss before stopping.
        min_delta: smaller improvements do not count.
        augment: random rotation/flip/zoom/contrast on training images.
        seed: seed of the initial weights, the relay order, sampling and augmentation.
        precision: ``auto`` (per device, :mod:`cxrfl.nn.precision`), ``fp32``, ``bf16`` or ``fp16``
            (autocast; weights and optimiser state stay float32).
        channels_last: ``auto`` (per device), true or false: channels-last memory format.
    """

    SECTION: ClassVar[str] = "cwt"
    LEGACY = LEGACY_AMP
    task: str = field(default="binary", metadata={"choices": TASKS})
    num_cycles: int = field(default=30, metadata={"ge": 1})
    order: str = field(default="fixed", metadata={"choices": ORDERS})
    local_steps: int | None = field(default=None, metadata={"ge": 1})
    plti: bool = False
    clr: bool = False
    lwms: bool = False
    cwl: bool = False
    lr: float = field(default=1e-3, metadata={"gt": 0})
    lr_decay: float = field(default=0.99, metadata={"gt": 0, "le": 1})
    lr_decay_every: int = field(default=200, metadata={"ge": 1})
    batch_size: int = field(default=32, metadata={"ge": 1})
    weight_decay: float = field(default=1e-4, metadata={"ge": 0})
    optimizer_state: str = field(default="travel", metadata={"choices": OPTIMIZER_STATES})
    patience: int = field(default=5, metadata={"ge": 1})
    min_delta: float = field(default=1e-4, metadata={"ge": 0})
    augment: bool = True
    seed: int = 0
    precision: str = precision_field()
    channels_last: str | bool = channels_last_field()

    @property
    def method(self) -> str:
        """A label such as ``CWT``, ``CWT+PLTI`` or ``CWT+LWMS+CWL``."""
        parts = [name.upper() for name in ("plti", "clr", "lwms", "cwl") if getattr(self, name)]
        return "+".join(["CWT", *parts])


@dataclass(frozen=True)
class RelayConfig(Config):
    """How the relay server treats the sites (the NVFlare controller's arguments beside the configs).

    Args:
        site_order: the fixed relay order (sites not listed follow in name order); None: by
            name. With ``order: shuffled`` it only fixes the list the permutations are drawn from.
        min_sites: fewest sites that must answer the counts task for the relay to start, and
            that must train in a cycle for the cycle to count (fewer: the cycle is run again
            from its starting model).
        min_sites_timeout: seconds of failed attempts (start or cycle) before the run stops
            with the reason.
        retry_pause: seconds between two attempts.
        evaluate_test: evaluate the best model on every site's test split at the end.
        pooled: how that evaluation counts at the sites and pools per class over the sites that
            label it (:class:`cxrfl.clinical.pooling.PooledEvaluation`, as surgical aggregation's).
    """

    SECTION: ClassVar[str] = "cwt_relay"
    site_order: tuple[str, ...] | None = None
    min_sites: int = field(default=1, metadata={"ge": 1})
    min_sites_timeout: float = field(default=600.0, metadata={"ge": 0})
    retry_pause: float = field(default=10.0, metadata={"ge": 0})
    evaluate_test: bool = True
    pooled: PooledEvaluation = field(default_factory=PooledEvaluation)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.site_order is not None and len(set(self.site_order)) != len(self.site_order):
            self.fail("site_order", f"must list distinct site names, got {list(self.site_order)}")
