"""What the FedFew benchmark runs: the methods, their labels, and the settings that decide the numbers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cxrfl.common.config import Config
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.nn.models import ARCHS, ModelConfig

METHODS = (
    "mlc",
    "mlc-ssl",
    "mlc-surgical",
    "mlc-surgical-ssl",
    "mlc-pooled",
    "nn-ssl",
    "nn-mlc-ssl",
    "fedfew-no-ebm",
    "fedfew",
    "fedfew-balanced",
    "fedfew-lambda1",
    "fedfew-neg-in",
    "fedfew-scorer",
    "fedfew-prototype",
    "fedfew-no-ebm-prototype",
)
"""Every method, in report order."""
LABELS = {
    "mlc": "MLC w/o FSSL",
    "mlc-ssl": "MLC w/ FSSL",
    "mlc-surgical": "MLC, masked BCE, rows stitched surgically*",
    "mlc-surgical-ssl": "MLC w/ FSSL, masked BCE, rows stitched surgically*",
    "mlc-pooled": "MLC, masked BCE, pooled data (oracle, not federated)*",
    "nn-ssl": "NN (FSSL)",
    "nn-mlc-ssl": "NN (MLC w/ FSSL)",
    "fedfew-no-ebm": "FedFew w/o EBM",
    "fedfew": "FedFew w/ EBM",
    "fedfew-balanced": "FedFew w/ EBM, balanced threshold*",
    "fedfew-lambda1": "FedFew w/ EBM, lambda = 1*",
    "fedfew-neg-in": "FedFew w/ EBM, UC negatives pushed in*",
    "fedfew-scorer": "FedFew, UC scorers*",
    "fedfew-prototype": "FedFew, UC prototype scorers*",
    "fedfew-no-ebm-prototype": "FedFew w/o EBM, UC prototype scorers*",
}
"""The paper's names of the methods (``*``: a labelled variant, not the paper's recipe)."""
ENERGY_VARIANTS = ("fedfew-lambda1", "fedfew-neg-in")
"""Variants of stage 2 that test what opens the energy gap between a UC's positives and negatives:
lambda 1 instead of 0.1, and the hinge below ``m_in`` on the UC sites' negatives (``uc_negatives: in``)."""
DEVICES = ("cpu", "cuda")
"""Where a benchmark's networks train and run (``cuda``: one GPU that every parallel seed shares)."""
IDENTITY_EXCLUDES = ("methods", "jobs", "device")
"""Settings that change which runs happen, how many at once or where, not any run's numbers (``auto`` precision
trains in bfloat16 on a GPU and on a CPU with native bfloat16; each run records its device)."""
BASELINES = ("mlc", "mlc-ssl", "mlc-surgical", "mlc-surgical-ssl")
"""The baselines the targets compare FedFew with."""


def _default_fedfew() -> dict[str, Any]:
    """The paper's recipe where it gives one (SimSiam's head sizes, batch 64, Adam at a fixed rate,
    T = 1, lambda = 0.1, margins from the warm-up), run until converged: 30 SimSiam rounds (each an
    epoch over the 6 training sites' images; the linear probes show the encoder's features per
    round budget), stage 2's phases until the CC validation loss stops improving (patience 5; at most 20
    warm-up and 40 energy rounds)."""
    return FedFewConfig(
        ssl_rounds=30,
        ssl_batch_size=64,
        ssl_proj_dim=2048,
        ssl_pred_dim=512,
        warmup_rounds=20,
        rounds=40,
        patience=5,
        local_epochs=1,
        batch_size=64,
        lr=1e-3,
        min_prototype_images=10,
        eval_batch_size=128,
    ).to_dict()


@dataclass(frozen=True)
class FedFewBenchSettings(Config):
    """Everything that decides the numbers (stored with the results).

    Args:
        image_size: training input side (the images are written at ``data_image_size``).
        arch: the network (:mod:`cxrfl.bench.arch`).
        data_image_size: side of the written synthetic images.
        n_cc: images per CC site (1,000: 3 sites give about 1,800 labelled training images,
            enough for DenseNet121 at 64 px to reach a CC AUROC above 0.75 when trained centrally in
            a one-off check on seed 0's data; 240 (about 440) left it below 0.68).
        n_test: images per test site (half positive for its UC: at least 200 positives per UC test set).
        cc_label_fraction: share of a CC site's training images that keep their labels.
        train_fraction: train share of the training sites (the rest is validation: stage 2's and
            the MLC baselines' early stopping).
        fedfew: :class:`FedFewConfig` fields (the seed is set per run).
        probe_every: stage-1 rounds between two linear probes of the encoder (round 0 and the
            last round always).
        mlc_rounds: most federated rounds of the MLC baselines.
        mlc_patience: their early stopping (rounds without a lower pooled validation loss), which ends a
            baseline no earlier than FedFew's warm-up budget (:func:`cxrfl.bench.fedfew.methods.mlc_min_rounds`).
        mlc_local_epochs: their local epochs per round.
        mlc_lr: their Adam learning rate.
        mlc_batch_size: their minibatch size.
        test_per_class: at most this many positives (and as many negatives) per UC test set.
        methods: the methods to run (:data:`METHODS`).
        threads: torch CPU threads per seed.
        jobs: seeds run in parallel processes.
        device: one of :data:`DEVICES` (recorded with each run).
    """

    SECTION: ClassVar[str] = "bench"
    image_size: int = field(default=64, metadata={"ge": 32})
    arch: str = field(default=ModelConfig.arch, metadata={"choices": ARCHS})
    data_image_size: int = field(default=64, metadata={"ge": 16})
    n_cc: int = field(default=1000, metadata={"ge": 1})
    n_test: int = field(default=600, metadata={"ge": 1})
    cc_label_fraction: float = field(default=0.75, metadata={"gt": 0, "le": 1})
    train_fraction: float = field(default=0.8, metadata={"gt": 0, "lt": 1})
    fedfew: dict[str, Any] = field(default_factory=_default_fedfew)
    probe_every: int = field(default=5, metadata={"ge": 1})
    mlc_rounds: int = field(default=40, metadata={"ge": 1})
    mlc_patience: int = field(default=5, metadata={"ge": 1})
    mlc_local_epochs: int = field(default=1, metadata={"ge": 1})
    mlc_lr: float = field(default=1e-3, metadata={"gt": 0})
    mlc_batch_size: int = field(default=64, metadata={"ge": 1})
    test_per_class: int = field(default=200, metadata={"ge": 1})
    methods: tuple[str, ...] = ("mlc", "mlc-ssl", "nn-ssl", "nn-mlc-ssl", "fedfew", "fedfew-balanced")
    threads: int = field(default=1, metadata={"ge": 1})
    jobs: int = field(default=2, metadata={"ge": 1})
    device: str = field(default="cpu", metadata={"choices": DEVICES})

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            self.fail("methods", f"has unknown method(s) {unknown}; available: {list(METHODS)}")
        FedFewConfig.from_dict(self.fedfew)

    def model_config(self) -> ModelConfig:
        """The network settings of every method."""
        return ModelConfig(arch=self.arch, image_size=self.image_size)

    @property
    def runs(self) -> tuple[str, ...]:
        """The methods run per seed, in report order (a method that reuses ``fedfew``'s stage files trains the
        stages it needs when they are missing, so ``fedfew`` itself need not be among them)."""
        return tuple(m for m in METHODS if m in self.methods)

    @property
    def probe_rounds(self) -> tuple[int, ...]:
        """The stage-1 rounds after which the encoder is probed (0: the initial weights)."""
        last = int(self.fedfew["ssl_rounds"])
        return tuple(sorted({*range(0, last + 1, self.probe_every), last}))

    def identity(self) -> dict[str, Any]:
        """The settings that decide a run's numbers (:meth:`to_dict` less :data:`IDENTITY_EXCLUDES`): runs and
        stage files of an equal identity are reused, so methods can be added to a finished benchmark."""
        return identity(self.to_dict())


def identity(settings: dict[str, Any]) -> dict[str, Any]:
    """Stored settings (a :meth:`FedFewBenchSettings.to_dict`, as JSON) less :data:`IDENTITY_EXCLUDES`, with the
    defaults of the fields added since they were stored (a new option's default keeps the old behaviour, so
    it does not invalidate earlier runs).

    Args:
        settings: the settings.
    """
    full = {**FedFewBenchSettings().to_dict(), **settings}
    full["fedfew"] = FedFewConfig.from_dict(full["fedfew"]).to_dict()
    return json.loads(json.dumps({k: v for k, v in full.items() if k not in IDENTITY_EXCLUDES}))


QUICK = FedFewBenchSettings(
    image_size=32,
    data_image_size=32,
    n_cc=120,
    n_test=80,
    probe_every=1,
    fedfew={
        **_default_fedfew(),
        "ssl_rounds": 1,
        "ssl_max_steps": 2,
        "ssl_batch_size": 32,
        "ssl_proj_dim": 64,
        "ssl_pred_dim": 16,
        "warmup_rounds": 1,
        "rounds": 2,
        "batch_size": 32,
        "min_prototype_images": 3,
    },
    mlc_rounds=2,
    mlc_patience=1,
    mlc_batch_size=32,
    test_per_class=30,
    jobs=1,
)
"""A few-minute smoke setting (not for reporting)."""
