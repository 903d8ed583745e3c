"""What the FedFew benchmark runs: the methods, their labels, and the settings that decide the numbers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cxrfl.fedfew.config import FedFewConfig

METHODS = ("mlc", "mlc-ssl", "nn-ssl", "nn-mlc-ssl", "fedfew-no-ebm", "fedfew", "fedfew-balanced")
"""Every method, in report order."""
LABELS = {"mlc": "MLC w/o FSSL", "mlc-ssl": "MLC w/ FSSL", "nn-ssl": "NN (FSSL)", "nn-mlc-ssl": "NN (MLC w/ FSSL)",
          "fedfew-no-ebm": "FedFew w/o EBM", "fedfew": "FedFew w/ EBM",
          "fedfew-balanced": "FedFew w/ EBM, balanced threshold*"}
"""The paper's names of the methods."""
BASELINES = ("mlc", "mlc-ssl")
"""The baselines the targets compare FedFew with."""


def _default_fedfew() -> dict[str, Any]:
    return FedFewConfig(ssl_rounds=1, ssl_max_steps=4, ssl_batch_size=32, ssl_proj_dim=512, ssl_pred_dim=128,
                        rounds=2, warmup_rounds=1, local_epochs=2, batch_size=32, lr=1e-3, min_prototype_images=10,
                        eval_batch_size=128).to_dict()


@dataclass(frozen=True)
class BenchSettings:
    """Everything that decides the numbers (stored with the results).

    Args:
        image_size: training input side (the images are written at ``data_image_size``).
        data_image_size: side of the written synthetic images.
        n_cc: images per CC site.
        cc_label_fraction: share of a CC site's training images that keep their labels.
        train_fraction: train share of the training sites (the rest is validation).
        fedfew: :class:`FedFewConfig` fields (the seed is set per run).
        mlc_rounds: federated rounds of the MLC baselines.
        mlc_local_epochs: their local epochs per round.
        mlc_lr: their Adam learning rate.
        mlc_batch_size: their minibatch size.
        test_per_class: at most this many positives (and as many negatives) per UC test set.
        methods: the methods to run (:data:`METHODS`; ``fedfew`` always runs: its stage 1 is the
            other methods' encoder).
        threads: torch CPU threads per seed.
        jobs: seeds run in parallel processes.
    """

    image_size: int = 32
    data_image_size: int = 64
    n_cc: int = 240
    cc_label_fraction: float = 0.75
    train_fraction: float = 0.9
    fedfew: dict[str, Any] = field(default_factory=_default_fedfew)
    mlc_rounds: int = 3
    mlc_local_epochs: int = 2
    mlc_lr: float = 1e-3
    mlc_batch_size: int = 32
    test_per_class: int = 100
    methods: tuple[str, ...] = ("mlc", "mlc-ssl", "nn-ssl", "nn-mlc-ssl", "fedfew", "fedfew-balanced")
    threads: int = 1
    jobs: int = 2

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; available: {list(METHODS)}")
        object.__setattr__(self, "methods", tuple(self.methods))
        FedFewConfig.from_dict(self.fedfew)

    @property
    def runs(self) -> tuple[str, ...]:
        """The methods run per seed, in report order (``fedfew`` always)."""
        return tuple(m for m in METHODS if m in self.methods or m == "fedfew")

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-friendly values."""
        d = asdict(self)
        d["methods"] = list(self.methods)
        return d


QUICK = BenchSettings(n_cc=120, fedfew={**_default_fedfew(), "ssl_rounds": 1, "ssl_max_steps": 2, "rounds": 1,
                                        "local_epochs": 1, "min_prototype_images": 3}, mlc_rounds=1, mlc_local_epochs=1,
                      test_per_class=30, jobs=1)
"""A few-minute smoke setting (not for reporting)."""
