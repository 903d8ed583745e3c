"""Settings of an evaluation-only run (:class:`FedEvalConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from cxrfl.clinical.operating import RULES, TARGETS
from cxrfl.clinical.pooling import PooledEvaluation

SPLITS = ("test", "val")


@dataclass(frozen=True)
class FedEvalConfig(PooledEvaluation):
    """Settings of one evaluation-only run: how sites count and the server pools (``min_cell``, ``bins``,
    ``tolerance``, ``level``, ``threshold``, ``subgroups``, here on by default:
    :class:`cxrfl.clinical.pooling.PooledEvaluation`), and:

    Args:
        split: the sites' split the model is scored on (``test``; ``val`` for calibration and thresholds).
        min_sites: fewest sites that must answer; fewer stop the run with the reason.
        calibration: ``platt`` or ``temperature``: fit a calibration map per class (``split: val`` only).
        target: ``sensitivity``, ``specificity`` or ``youden``: choose an operating point per class
            (``split: val`` only).
        target_value: the sensitivity or specificity ``target`` asks for (none for ``youden``).
        threshold_rule: ``new_data`` (the expected rate on new images reaches ``target_value``) or
            ``validation`` (the rate on the validation split does; biased low on small splits).
        calibration_alpha: the consortium's map of a class is kept only where it fits the pooled validation
            counts better than the raw scores in a likelihood-ratio test at this level.
        site_fits: also send each site its copy of the fit (its own classes; per class the raw scores, the
            consortium's map or one fitted to its own counts, whichever fits them best by AIC), written by
            the site as ``<workspace>/cxrfl_state/site_models/<job>.pt``.

    With ``calibration`` or ``target`` the run also writes ``cxrfl/calibrated_model.pt``: the model with
    its maps and operating points (:class:`cxrfl.clinical.fitted.ClinicalFit`), which ``cxrfl predict``
    and the MONAI bundle apply.
    """

    SECTION: ClassVar[str] = "fedeval"
    subgroups: bool = True  # an evaluation run audits by sex, age band and view (training jobs: off)
    split: str = field(default="test", metadata={"choices": SPLITS})
    min_sites: int = field(default=1, metadata={"ge": 1})
    calibration: str | None = field(default=None, metadata={"choices": ("platt", "temperature")})
    target: str | None = field(default=None, metadata={"choices": TARGETS})
    target_value: float | None = field(default=None, metadata={"gt": 0, "le": 1})
    threshold_rule: str = field(default="new_data", metadata={"choices": RULES})
    calibration_alpha: float = field(default=0.05, metadata={"gt": 0, "le": 1})
    site_fits: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.calibration or self.target) and self.split != "val":
            self.fail(
                "split",
                f"must be 'val' to fit calibration or operating points (on validation data only, "
                f"never on the test split), got {self.split!r}",
            )
        if self.target in ("sensitivity", "specificity") and self.target_value is None:
            self.fail("target_value", f"is needed with target {self.target!r} (e.g. 0.9)")
        if self.target_value is not None and self.target not in ("sensitivity", "specificity"):
            self.fail("target_value", f"is only used with target 'sensitivity' or 'specificity', got {self.target!r}")

    @property
    def fits(self) -> bool:
        """Whether the run fits calibration maps or operating points."""
        return bool(self.calibration or self.target)
