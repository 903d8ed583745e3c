"""The server settings of surgical aggregation and its baselines, with their defaults (the only copy).

The NVFlare workflow (:class:`cxrfl.fl.surgical.SurgicalAggregation`) takes them as job arguments,
the benchmark and the tests build them directly; :class:`cxrfl.surgical.server.SurgicalServer` runs
them. ``model_config`` and ``train_config`` travel to the sites in every task.

Two rules about where the network starts from:

- FedBN+ freezes BatchNorm at the statistics of a *pretrained* feature extractor (the papers:
  ImageNet weights). From scratch those statistics are torch's initial ones (mean 0, variance 1),
  which is not FedBN+: ``batchnorm="fedbn+"`` without ``model_config.pretrained`` is refused.
- The papers' fine-tuning rate (Adam 5e-5, the ``TrainConfig`` default) is for ImageNet-initialised
  networks. From scratch (``pretrained: null``) a rate at or below :data:`FINE_TUNING_LR` barely
  moves DenseNet121 in the rounds a job has; :meth:`SurgicalConfig.rate_warning` says so in one
  line (the server logs it when a run starts) and suggests :data:`FROM_SCRATCH_LR` (Adam 1e-3:
  measured here to reach 0.72-0.75 mean test AUROC from scratch at 64 px in 7-9 epochs). The
  setting is left as given: a user may mean it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from cxrfl.clinical.pooling import PooledEvaluation
from cxrfl.common.config import Config
from cxrfl.core.fedavg import WEIGHTINGS
from cxrfl.core.updates import MAX_NUM_SAMPLES
from cxrfl.errors import ConfigError
from cxrfl.nn.models import ModelConfig
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.aggregation import check_options
from cxrfl.surgical.head_modes import BATCHNORM_MODES, HEAD_MODES, MISSING_POLICIES, SELECTION_RULES

RESUME_KEYS = ("model_config", "batchnorm", "head_mode", "missing", "seed")
"""Settings a resumed run must share with the interrupted one (they decide the model)."""

FINE_TUNING_LR = 1e-4
"""Rates at or below this are fine-tuning rates (the papers: 5e-5 from ImageNet weights)."""
FROM_SCRATCH_LR = 1e-3
"""The rate suggested from scratch (Adam; see the module docstring)."""


@dataclass(frozen=True)
class SurgicalConfig(Config):
    """Settings of one surgical-aggregation run (or of a baseline: see ``head_mode``).

    Args:
        num_rounds: maximum number of federated rounds after the warm-up.
        min_clients: fewest valid site results that make a round; fewer keep the previous model.
        model_config: :class:`cxrfl.nn.models.ModelConfig` (or its fields).
        train_config: :class:`cxrfl.nn.training.TrainConfig` (or its fields), sent to the sites.
        batchnorm: ``fedavg``, ``fedbn`` (BatchNorm local) or ``fedbn+`` (frozen at the statistics of
            the pretrained feature extractor; needs ``model_config.pretrained``).
        weighting: ``uniform`` (the papers) or ``samples``.
        robust: None, ``median`` or ``clip`` robust aggregation (off by default) of every
            aggregation: warm-up, rounds and late joins (:func:`cxrfl.surgical.aggregation.surgical_aggregate`).
        clip_norm: update norm bound for ``clip``, and for the groups of fewer than 3 sites a
            ``median`` cannot protect; null: each round's lower median update norm (adaptive).
        max_num_samples: the largest ``num_samples`` a site may report; a site must also keep
            reporting about the count of its first accepted result (its split is fixed).
        patience: rounds without improvement of the mean validation loss before stopping.
        min_delta: improvement smaller than this does not count.
        time_budget: seconds the warm-up and the rounds may take, counted from the run's start; no
            round starts that would, at the pace of the slowest round so far, end after it. The last
            model is then scored and the best selected as usual. null: no budget (rounds stop on
            ``patience`` or ``num_rounds``).
        min_clients_timeout: seconds without a completed round (fewer than ``min_clients`` valid
            results: the round is run again) before the run stops with the reason.
        retry_pause: seconds between two attempts at a round.
        resume_from: continue an interrupted run: its run (job) id on this server (a plain name,
            never a folder).
        seed: seed of the initial weights.
        evaluate_test: evaluate the selected model on every site's test split at the end.
        external_test: server-side site config of a fully annotated external test set (optional).
        pooled: how the final test evaluation counts at the sites and pools per class
            (:class:`cxrfl.clinical.pooling.PooledEvaluation`: minimum cell size, bins, interval level ...).
        keep_round_checkpoints: keep every round's global model under ``cxrfl/checkpoints``.
        head_mode: ``surgical`` (own head rows per site), ``union`` (whole head to every site:
            vanilla FL / partial loss) or ``local`` (heads stay at the sites: personalized FL).
        missing: for ``union`` heads, classes a site does not annotate are ``negative`` (vanilla
            FL) or ``ignore``-d in its loss (FL with partial loss).
        selection: what a site's validation loss, which selects the model, counts:
            ``annotated`` (its own classes, for every head mode) or ``head`` (the rule before
            issue 41; see :data:`cxrfl.surgical.head_modes.SELECTION_RULES`).
    """

    SECTION: ClassVar[str] = "surgical"
    num_rounds: int = field(default=20, metadata={"ge": 0})
    min_clients: int = field(default=2, metadata={"ge": 1})
    model_config: ModelConfig = field(default_factory=ModelConfig)
    train_config: TrainConfig = field(default_factory=TrainConfig)
    batchnorm: str = field(default="fedavg", metadata={"choices": BATCHNORM_MODES})
    weighting: str = field(default="uniform", metadata={"choices": WEIGHTINGS})
    robust: str | None = field(default=None, metadata={"choices": ("median", "clip")})
    clip_norm: float | None = field(default=None, metadata={"gt": 0})
    max_num_samples: int = field(default=MAX_NUM_SAMPLES, metadata={"ge": 1})
    patience: int = field(default=5, metadata={"ge": 1})
    min_delta: float = field(default=1e-4, metadata={"ge": 0})
    time_budget: float | None = field(default=None, metadata={"gt": 0})
    min_clients_timeout: float = field(default=600, metadata={"ge": 0})
    retry_pause: float = field(default=10, metadata={"ge": 0})
    resume_from: str | None = None
    seed: int = 0
    evaluate_test: bool = True
    external_test: str | None = None
    pooled: PooledEvaluation = field(default_factory=PooledEvaluation)
    keep_round_checkpoints: bool = True
    head_mode: str = field(default="surgical", metadata={"choices": HEAD_MODES})
    missing: str = field(default="negative", metadata={"choices": MISSING_POLICIES})
    selection: str = field(default="annotated", metadata={"choices": SELECTION_RULES})

    def __post_init__(self) -> None:
        for name, kind in (("model_config", ModelConfig), ("train_config", TrainConfig)):  # None: the defaults
            value = getattr(self, name)
            if value is None or isinstance(value, Mapping):
                object.__setattr__(self, name, kind.from_dict(value))
        super().__post_init__()
        try:
            check_options(self.weighting, self.batchnorm, self.robust, self.clip_norm)
        except ValueError as exc:
            raise ConfigError(f"{self.SECTION}: {exc}") from None
        if self.batchnorm == "fedbn+" and not self.model_config.pretrained:
            self.fail(
                "batchnorm",
                "'fedbn+' freezes BatchNorm at the statistics of a pretrained feature extractor, but "
                "model_config.pretrained is null (from scratch they would be torch's initial mean 0 / "
                "variance 1): set model_config.pretrained to a local checkpoint (e.g. ImageNet "
                "DenseNet121 weights), or use batchnorm 'fedbn' or 'fedavg' from scratch",
            )

    def rate_warning(self) -> str | None:
        """One line when the network trains from scratch at a fine-tuning rate (None otherwise)."""
        lr = self.train_config.lr
        if self.model_config.pretrained or lr > FINE_TUNING_LR:
            return None
        return (
            f"train_config.lr={lr:g} is a fine-tuning rate (the papers' 5e-5 is for ImageNet-initialised networks) but "
            f"model_config.pretrained is null (from scratch): expect little learning; use lr {FROM_SCRATCH_LR:g} "
            f"(Adam, measured to learn from scratch) or a local pretrained checkpoint"
        )
