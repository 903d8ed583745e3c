"""FedFew settings: one frozen dataclass, sent by the server to every site with each task."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from cxrfl.errors import ConfigError

ENERGY_OUTPUTS = ("all", "cc")
"""Which outputs the joint energy sums over: ``all`` (the CCs and the extra "no CC" output, so
that an image with no CC at all is also "in"; the default) or ``cc`` (the CC outputs only)."""
UC_ENERGY_ON = ("positives", "all")
"""Which images of a UC site get the hinge pushing the energy above ``m_out``: its UC positives
(the default: they are the paper's x_out) or all its labelled images."""
THRESHOLD_EXAMPLES = ("uc_labelled", "all")
"""The training examples the threshold is chosen on: ``uc_labelled`` (the images whose UC status
is known: the UC sites' positives, which should be above it, and negatives, which should be
below; the default, as a CC site's image may hold a UC nobody labelled there) or ``all`` (also
every CC-labelled image as one that should be below)."""
THRESHOLD_WEIGHTINGS = ("count", "balanced")
"""``count``: the threshold classifies the most training examples correctly (the paper);
``balanced``: the mean of the in and out accuracies is maximal."""


@dataclass(frozen=True)
class FedFewConfig:
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
        rounds: federated rounds with the energy term (after the warm-up rounds).
        warmup_rounds: rounds without the energy term that precede them when a margin is not
            given (the margins are then chosen from the energies of the warm-up model).
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
        augment: random rotation/flip/zoom/contrast of training images.

    Classes:

    Args:
        uc_classes: the UCs by name (None: found from the sites' label counts: a class is a UC
            when it is labelled at fewer than ``cc_min_sites`` sites AND has fewer than
            ``uc_max_positives`` labelled positive training images in the federation).
        cc_min_sites: see ``uc_classes``.
        uc_max_positives: see ``uc_classes``.

    Stage 3 (threshold and prototypes):

    Args:
        min_prototype_images: fewest images behind a prototype; a site refuses to send a
            prototype averaged over fewer (so that no prototype describes one patient).
        threshold_bins: candidate thresholds the sites count errors for.
        threshold_weighting: see :data:`THRESHOLD_WEIGHTINGS`.
        threshold_examples: see :data:`THRESHOLD_EXAMPLES`.

    General:

    Args:
        seed: seed of weight initialisation, shuffling and augmentation.
        amp: mixed precision on CUDA (ignored on CPU).
        eval_batch_size: images per batch for energies, features and evaluation.
    """

    ssl_rounds: int = 2
    ssl_local_epochs: int = 1
    ssl_lr: float = 1e-3
    ssl_batch_size: int = 32
    ssl_max_steps: int | None = None
    ssl_proj_dim: int = 2048
    ssl_pred_dim: int = 512
    ssl_splits: tuple[str, ...] = ("train", "val")
    rounds: int = 5
    warmup_rounds: int = 1
    local_epochs: int = 1
    lr: float = 1e-3
    batch_size: int = 32
    max_steps_per_epoch: int | None = None
    temperature: float = 1.0
    m_in: float | None = None
    m_out: float | None = None
    margin_widen: float = 1.0
    energy_weight: float = 0.1
    energy_outputs: str = "all"
    uc_energy_on: str = "positives"
    augment: bool = True
    uc_classes: tuple[str, ...] | None = None
    cc_min_sites: int = 2
    uc_max_positives: int = 100
    min_prototype_images: int = 10
    threshold_bins: int = 512
    threshold_weighting: str = "count"
    threshold_examples: str = "uc_labelled"
    seed: int = 0
    amp: bool = True
    eval_batch_size: int = 64

    def __post_init__(self) -> None:
        ints = {
            "ssl_rounds": 0, "ssl_local_epochs": 1, "ssl_batch_size": 2, "ssl_proj_dim": 1, "ssl_pred_dim": 1,
            "rounds": 0, "warmup_rounds": 0, "local_epochs": 1, "batch_size": 1, "cc_min_sites": 1,
            "uc_max_positives": 0, "min_prototype_images": 1, "threshold_bins": 2, "eval_batch_size": 1,
        }
        for name, low in ints.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"fedfew.{name} must be an integer >= {low}, got {value!r}")
        for name in ("ssl_max_steps", "max_steps_per_epoch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"fedfew.{name} must be an integer >= 1 or null, got {value!r}")
        for name in ("ssl_lr", "lr", "temperature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"fedfew.{name} must be a number > 0, got {value!r}")
        for name in ("margin_widen", "energy_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"fedfew.{name} must be a number >= 0, got {value!r}")
        for name in ("m_in", "m_out"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"fedfew.{name} must be a number or null, got {value!r}")
        if self.m_in is not None and self.m_out is not None and self.m_in >= self.m_out:
            raise ConfigError(f"fedfew.m_in ({self.m_in}) must be below fedfew.m_out ({self.m_out})")
        for name, allowed in (("energy_outputs", ENERGY_OUTPUTS), ("uc_energy_on", UC_ENERGY_ON),
                              ("threshold_weighting", THRESHOLD_WEIGHTINGS), ("threshold_examples", THRESHOLD_EXAMPLES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"fedfew.{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        splits = tuple(self.ssl_splits)
        if not splits or any(s not in ("train", "val", "test") for s in splits):
            raise ConfigError(f"fedfew.ssl_splits must name train/val/test splits, got {list(self.ssl_splits)!r}")
        object.__setattr__(self, "ssl_splits", splits)
        if self.uc_classes is not None:
            ucs = tuple(str(c) for c in self.uc_classes)
            if not ucs or len(set(ucs)) != len(ucs):
                raise ConfigError(f"fedfew.uc_classes must be a non-empty list of distinct names or null, got {self.uc_classes!r}")
            object.__setattr__(self, "uc_classes", ucs)

    @property
    def margins_given(self) -> bool:
        """Both margins are set in the config (no warm-up is needed to choose them)."""
        return self.m_in is not None and self.m_out is not None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON friendly; tuples as lists)."""
        d = asdict(self)
        d["ssl_splits"] = list(self.ssl_splits)
        d["uc_classes"] = list(self.uc_classes) if self.uc_classes is not None else None
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> FedFewConfig:
        """Build from a mapping, rejecting unknown keys.

        Args:
            data: the settings (None or missing keys: defaults).
        """
        data = dict(data or {})
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown fedfew setting(s): {', '.join(sorted(unknown))}")
        for key in ("ssl_splits", "uc_classes"):
            if isinstance(data.get(key), list):
                data[key] = tuple(data[key])
        return cls(**data)

    def replace(self, **changes: Any) -> FedFewConfig:
        """A copy with some settings changed (validated)."""
        return FedFewConfig.from_dict({**self.to_dict(), **changes})
