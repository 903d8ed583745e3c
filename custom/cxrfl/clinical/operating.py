"""Operating points chosen by the server from pooled validation score counts.

Only :class:`~cxrfl.clinical.counts.ScoreCounts` reach the server. A threshold is a bin edge
(positive when score >= threshold): the largest one that reaches a target sensitivity, the
smallest that reaches a target specificity, or the one of largest Youden's J. By default a target is
read for NEW images (rule ``new_data``): with ``k`` of ``n`` validation positives at or above a threshold,
a new positive exchangeable with them lands there with probability ``k / (n + 1)`` (its rank among the
``n + 1`` scores is uniform), so the threshold must reach ``k / (n + 1) >= target``, not ``k / n``: the
plain rule (``validation``) is biased low on small splits (9 of 10 positives: 0.82 expected, not 0.90).
Every edge between
two non-empty bins gives the same validation counts; of those equivalent edges the middle one
(in logits) is taken, so the threshold sits in the gap between the validation scores. The
point is stored with the sensitivity and specificity it reached and their Wilson intervals.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from cxrfl.clinical.counts import ScoreCounts
from cxrfl.clinical.pooled import SensSpec, at_cut

TARGETS = ("sensitivity", "specificity", "youden")
RULES = ("new_data", "validation")


@dataclass(frozen=True)
class OperatingPoint:
    """A chosen threshold of one class and what it reached on the data it was chosen on.

    Args:
        target: ``sensitivity``, ``specificity`` or ``youden``.
        value: the target sensitivity or specificity (None for ``youden``).
        met: whether the target was reached (False: the threshold that comes closest, keeping every
            validation positive, or negative, that any threshold keeps).
        point: the threshold with its sensitivity and specificity.
    """

    target: str
    value: float | None
    met: bool
    point: SensSpec

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict."""
        return dataclasses.asdict(self)


def choose_threshold(
    counts: ScoreCounts, target: str, value: float | None = None, *, rule: str = "new_data", level: float = 0.95
) -> OperatingPoint:
    """Choose a class's threshold from its pooled validation counts.

    Args:
        counts: merged validation counts of one class.
        target: ``sensitivity`` (keep at least ``value`` of the positives, best specificity),
            ``specificity`` (at least ``value`` of the negatives, best sensitivity) or
            ``youden`` (largest sensitivity + specificity - 1).
        value: the target proportion in (0, 1]; only for ``sensitivity`` and ``specificity``.
        rule: ``new_data`` (the expected rate on new images reaches ``value``) or ``validation`` (the
            rate on the validation counts does; see the module docstring).
        level: confidence level of the reached rates' intervals.
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {list(TARGETS)}, got {target!r}")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {list(RULES)}, got {rule!r}")
    if (target == "youden") != (value is None) or (value is not None and not 0 < value <= 1):
        raise ValueError(
            f"target {target!r} needs a value in (0, 1] for sensitivity or specificity "
            f"and none for youden, got {value!r}"
        )
    n = counts.bins.n
    tp = np.cumsum(counts.positives[::-1])[::-1][1:]  # tp[i]: positives in bins i+1 ... (cut i+1)
    tn = np.cumsum(counts.negatives)[: n + 1]  # tn[i]: negatives in bins 0 ... i
    extra = 1 if rule == "new_data" else 0  # the new image joins the n validation cases
    if target == "sensitivity":
        assert value is not None  # checked above
        ok = np.flatnonzero(tp / (counts.n_pos + extra) >= value)
        # out of reach (e.g. 7 positives: at most 7/8 expected): the highest cut that keeps them all
        i, met = (int(ok[-1]), True) if ok.size else (int(np.flatnonzero(tp == tp.max())[-1]), False)
    elif target == "specificity":
        assert value is not None  # checked above
        ok = np.flatnonzero(tn / (counts.n_neg + extra) >= value)
        i, met = (int(ok[0]), True) if ok.size else (int(np.flatnonzero(tn == tn.max())[0]), False)
    else:
        i, met = int(np.argmax(tp / counts.n_pos + tn / counts.n_neg)), True
    same = np.flatnonzero((tp == tp[i]) & (tn == tn[i]))  # contiguous: tp falls and tn rises with the cut
    return OperatingPoint(target, value, met, at_cut(counts, int(same[same.size // 2]) + 1, level=level))
