"""FedFew settings: one frozen dataclass, sent by the server to every site with each task."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from cxrfl.common.config import Config
from cxrfl.core.fedavg import check_options
from cxrfl.core.updates import MAX_NUM_SAMPLES
from cxrfl.errors import ConfigError
from cxrfl.nn.precision import LEGACY_AMP, channels_last_field, precision_field

ENERGY_OUTPUTS = ("all", "cc")
"""Which outputs the joint energy sums over: ``all`` (the CCs and the extra "no CC" output, so
that an image with no CC at all is also "in"; the default) or ``cc`` (the CC outputs only)."""
UC_ENERGY_ON = ("positives", "all")
"""Which images of a UC site get the hinge pushing the energy above ``m_out``: its UC positives
(the default: they are the paper's x_out) or all its labelled images."""
UC_NEGATIVES = ("none", "in")
"""What a UC site's negatives (known to hold none of its UCs) get in stage 2: ``none`` (no loss,
the default: the paper names no term for them) or ``in`` (the hinge pushing their energy below
``m_in``, as images without a UC: a labelled variant that puts both sides of the energy gap
at every UC site)."""
THRESHOLD_EXAMPLES = ("uc_labelled", "all")
"""The training examples the threshold is chosen on: ``uc_labelled`` (the images whose UC status
is known: the UC sites' positives, which should be above it, and negatives, which should be
below; the default, as a CC site's image may hold a UC nobody labelled there) or ``all`` (also
every CC-labelled image as one that should be below)."""
DETECTORS = ("paper", "scorer")
"""How stage 3 detects a UC: ``paper`` (the paper's recipe: an image whose joint energy is above
the threshold is matched to the nearer of each UC site's dual prototypes; the default) or
``scorer`` (each UC site fits a class-balanced linear scorer on its positives and negatives, its
threshold chosen out of fold; :mod:`cxrfl.fedfew.scorer`). The energy threshold is chosen and
stored either way (a diagnostic under ``scorer``)."""
SCORER_MODELS = ("logistic", "prototype")
"""The rule a UC scorer fits: ``logistic`` (a class-balanced L2-penalised logistic regression on standardised
features, its strength chosen by inner cross-validated AUROC; the default) or ``prototype`` (the dual prototype's
cosine margin ``cos(x, p+) - cos(x, p-)`` with the means of the site's positives and negatives: nothing tuned
but the threshold, which is still chosen out of fold)."""
THRESHOLD_WEIGHTINGS = ("count", "balanced")
"""``count``: the threshold classifies the most training examples correctly (the paper);
``balanced``: the mean of the in and out accuracies is maximal."""


@dataclass(frozen=True)
class FedFewConfig(Config):
    """Settings of the three FedFew stages (paper values where it gives them).

    Stage 1 (federated SimSiam):

    Args:
        ssl_rounds: federated rounds of self-supervised pretraining (0: no stage 1).
        ssl_local_epochs: local epochs per round.
        ssl_lr: Adam learning rate (the paper: Adam, fixed learning rate, for both stages).
        ssl_batch_size: images per minibatch (two views each).
        ssl_max_steps: cap on local optimiser steps per epoch (None: the whole set).
        ssl_proj_dim: SimSiam projector output size (SimSiam: 2048).
        ssl_pred_dim: SimSiam predictor bottleneck (SimSiam: 512).
        ssl_splits: the site splits whose images (labelled or not) are used for pretraining.

    Stage 2 (energy-based multi-label training over the CCs):

    Args:
        rounds: most federated rounds with the energy term (after the warm-up rounds).
        warmup_rounds: most rounds without the energy term that precede them when a margin is
            not given (the margins are then chosen from the energies of the warm-up model).
        patience: stage 2's early stopping: after every round the CC sites score the new model
            on their validation split (BCE over the CCs and "no CC", pooled over the known
            labels); a phase (warm-up, then energy rounds) ends after ``patience`` rounds without
            an improvement of ``min_delta``, and its model of lowest loss is kept (the warm-up's
            starts the energy rounds and chooses the margins; the energy rounds' is stage 2's
            result). ``rounds`` and ``warmup_rounds`` stay the most rounds. None: no scoring,
            every round runs and the last model is kept.
        min_delta: smallest decrease of the validation loss that counts as an improvement.
        local_epochs: local epochs per round (the paper: E = 1).
        lr: Adam learning rate.
        batch_size: images per minibatch (the paper: 64).
        max_steps_per_epoch: cap on local optimiser steps per epoch (None: the whole set).
        temperature: T of the energy score (the paper and Liu et al.: 1).
        m_in: margin below which a CC site's images' energy is pushed (None: from the warm-up).
        m_out: margin above which a UC site's images' energy is pushed (None: from the warm-up).
        margin_widen: with margins from the warm-up, ``m_in = mean_in - margin_widen`` and
            ``m_out = max(mean_out, mean_in) + margin_widen`` ("intentionally enlarge the gap").
        energy_weight: lambda, the weight of the hinge terms (Liu et al.: 0.1).
        energy_outputs: see :data:`ENERGY_OUTPUTS`.
        uc_energy_on: see :data:`UC_ENERGY_ON`.
        uc_negatives: see :data:`UC_NEGATIVES`.
        augment: random rotation/flip/zoom/contrast of training images.

    Classes:

    Args:
        uc_classes: the UCs by name (None: found from the sites' label counts: a class is a UC
            when it is labelled at fewer than ``cc_min_sites`` sites AND has fewer than
            ``uc_max_positives`` labelled positive training images in the federation).
        cc_min_sites: see ``uc_classes``.
        uc_max_positives: see ``uc_classes``.

    Stage 3 (threshold and the UC detectors):

    Args:
        detector: see :data:`DETECTORS`.
        min_prototype_images: fewest images behind a prototype or scorer; a site refuses to send
            one over fewer positives or negatives (so that none describes one patient).
        scorer_folds: cross-validation folds of a scorer (its L2 strength and threshold); a
            scorer also needs this many positives and negatives.
        scorer_model: see :data:`SCORER_MODELS`.
        threshold_bins: candidate thresholds the sites count errors for.
        threshold_weighting: see :data:`THRESHOLD_WEIGHTINGS`.
        threshold_examples: see :data:`THRESHOLD_EXAMPLES`.

    Federated averaging (stages 1-2; the server's, :meth:`cxrfl.fedfew.rounds.FederatedRounds.fedavg`):

    Args:
        robust: None (FedAvg weighted by images), ``median`` (coordinate-wise, unweighted) or
            ``clip`` (each update's distance from the round's start clipped to ``clip_norm``); see
            :func:`cxrfl.core.fedavg.fedavg_keys` (one norm over the whole update).
        clip_norm: the norm bound of ``clip``, and of a ``median`` of fewer than 3 sites; null: each round's
            lower median update norm (adaptive).
        max_num_samples: the largest image count a site may report; a site must also keep reporting
            about the count of its first accepted result of a stage.

    General:

    Args:
        seed: seed of weight initialisation, shuffling and augmentation.
        precision: ``auto`` (per device, :mod:`cxrfl.nn.precision`), ``fp32``, ``bf16`` or ``fp16``
            (autocast; weights and optimiser state stay float32).
        channels_last: ``auto`` (per device), true or false: channels-last memory format.
        eval_batch_size: images per batch for energies, features and evaluation.
    """

    SECTION: ClassVar[str] = "fedfew"
    LEGACY = LEGACY_AMP
    ssl_rounds: int = field(default=2, metadata={"ge": 0})
    ssl_local_epochs: int = field(default=1, metadata={"ge": 1})
    ssl_lr: float = field(default=1e-3, metadata={"gt": 0})
    ssl_batch_size: int = field(default=32, metadata={"ge": 2})
    ssl_max_steps: int | None = field(default=None, metadata={"ge": 1})
    ssl_proj_dim: int = field(default=2048, metadata={"ge": 1})
    ssl_pred_dim: int = field(default=512, metadata={"ge": 1})
    ssl_splits: tuple[str, ...] = ("train", "val")
    rounds: int = field(default=5, metadata={"ge": 0})
    warmup_rounds: int = field(default=1, metadata={"ge": 0})
    patience: int | None = field(default=5, metadata={"ge": 1})
    min_delta: float = field(default=0.0, metadata={"ge": 0})
    local_epochs: int = field(default=1, metadata={"ge": 1})
    lr: float = field(default=1e-3, metadata={"gt": 0})
    batch_size: int = field(default=32, metadata={"ge": 1})
    max_steps_per_epoch: int | None = field(default=None, metadata={"ge": 1})
    temperature: float = field(default=1.0, metadata={"gt": 0})
    m_in: float | None = None
    m_out: float | None = None
    margin_widen: float = field(default=1.0, metadata={"ge": 0})
    energy_weight: float = field(default=0.1, metadata={"ge": 0})
    energy_outputs: str = field(default="all", metadata={"choices": ENERGY_OUTPUTS})
    uc_energy_on: str = field(default="positives", metadata={"choices": UC_ENERGY_ON})
    uc_negatives: str = field(default="none", metadata={"choices": UC_NEGATIVES})
    augment: bool = True
    uc_classes: tuple[str, ...] | None = None
    cc_min_sites: int = field(default=2, metadata={"ge": 1})
    uc_max_positives: int = field(default=100, metadata={"ge": 0})
    detector: str = field(default="paper", metadata={"choices": DETECTORS})
    min_prototype_images: int = field(default=10, metadata={"ge": 1})
    scorer_folds: int = field(default=5, metadata={"ge": 2})
    scorer_model: str = field(default="logistic", metadata={"choices": SCORER_MODELS})
    threshold_bins: int = field(default=512, metadata={"ge": 2})
    threshold_weighting: str = field(default="count", metadata={"choices": THRESHOLD_WEIGHTINGS})
    threshold_examples: str = field(default="uc_labelled", metadata={"choices": THRESHOLD_EXAMPLES})
    robust: str | None = field(default=None, metadata={"choices": ("median", "clip")})
    clip_norm: float | None = field(default=None, metadata={"gt": 0})
    max_num_samples: int = field(default=MAX_NUM_SAMPLES, metadata={"ge": 1})
    seed: int = 0
    precision: str = precision_field()
    channels_last: str | bool = channels_last_field()
    eval_batch_size: int = field(default=64, metadata={"ge": 1})

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            check_options("uniform", self.robust, self.clip_norm)
        except ValueError as exc:
            raise ConfigError(f"{self.SECTION}: {exc}") from None
        if self.m_in is not None and self.m_out is not None and self.m_in >= self.m_out:
            self.fail("m_in", f"({self.m_in}) must be below fedfew.m_out ({self.m_out})")
        if self.uc_negatives == "in" and self.uc_energy_on == "all":
            self.fail(
                "uc_negatives",
                "'in' pushes a UC site's negatives down while fedfew.uc_energy_on 'all' pushes them up; choose one",
            )
        if not self.ssl_splits or any(s not in ("train", "val", "test") for s in self.ssl_splits):
            self.fail("ssl_splits", f"must name train/val/test splits, got {list(self.ssl_splits)!r}")
        if self.uc_classes is not None and (not self.uc_classes or len(set(self.uc_classes)) != len(self.uc_classes)):
            self.fail(
                "uc_classes", f"must be a non-empty list of distinct names or null, got {list(self.uc_classes)!r}"
            )

    @property
    def margins_given(self) -> bool:
        """Both margins are set in the config (no warm-up is needed to choose them)."""
        return self.m_in is not None and self.m_out is not None
