"""Settings of an evaluation-only run (:class:`FedEvalConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from cxrfl.clinical.counts import BinSpec
from cxrfl.common.config import Config

SPLITS = ("test", "val")


@dataclass(frozen=True)
class FedEvalConfig(Config):
    """Settings of one evaluation-only run.

    Args:
        split: the sites' split the model is scored on (``test``; ``val`` for calibration and thresholds).
        min_cell: the least positives and negatives of a class a site sends counts for (else nothing).
        bins: the first pass's bins (:class:`cxrfl.clinical.counts.BinSpec`).
        tolerance: largest accepted bound on the binning error of a pooled AUROC; a class above it is
            counted again in bins fitted to its pooled scores (one second pass).
        level: confidence level of the intervals.
        threshold: the probability whose sensitivity and specificity are reported.
        min_sites: fewest sites that must answer; fewer stop the run with the reason.
    """

    SECTION: ClassVar[str] = "fedeval"
    split: str = field(default="test", metadata={"choices": SPLITS})
    min_cell: int = field(default=10, metadata={"ge": 1})
    bins: BinSpec = field(default_factory=BinSpec)
    tolerance: float = field(default=0.002, metadata={"gt": 0})
    level: float = field(default=0.95, metadata={"gt": 0, "lt": 1})
    threshold: float = field(default=0.5, metadata={"gt": 0, "lt": 1})
    min_sites: int = field(default=1, metadata={"ge": 1})
