"""Binned score counts: the only thing a site sends for federated evaluation (issue 45).

Per class, a site sends how many of its positives and of its negatives scored in each bin of a
fixed :class:`BinSpec` (integers, JSON lists), or nothing when it has fewer than ``min_cell``
positives or negatives for that class. No score, label or image leaves the site. The server
checks what it receives (:meth:`ScoreCounts.from_dict`) and adds the sites' counts (:func:`merge`).

Binning. Scores are sigmoid probabilities; bins are equal-width on the LOGIT scale over
``[low, high]`` with an open bin below and one above (``n + 2`` bins). Equal bins on [0, 1] put
the many low scores of a rare finding (probabilities below 0.01) into a handful of bins; logit
bins are as fine in the tails as in the middle (table: at least ten times closer with as many
bins). The pooled AUROC computed from the bins counts a positive and a negative of the same
bin as half a correct pair, so it differs from the AUROC of the raw scores by at most
``sum_k pos_k neg_k / (2 P N)`` (:attr:`cxrfl.clinical.pooled.Auroc.binning_bound`, from the
counts).

Measured (binormal logits, 5,000 scores per case, float32 probabilities; negatives' logit SD
0.05-4, separation 0.1-2 SDs, prevalence 1-50 %, centres -6 to 3 logits), worst
``|AUROC(bins) - sklearn roc_auc_score(raw scores)|`` by the smallest SD in the set:

=====================  =========  =========  =========  =========
bins: n, [low, high]   SD >= 0.5  SD >= 0.2  SD >= 0.1  SD >= 0.05
=====================  =========  =========  =========  =========
4000 equal on [0, 1]   0.025      0.025      0.029      0.073
2000, [-12, 12]        0.0013     0.0018     0.0033     0.0075
2000, [-16, 16]        0.00066    0.0020     0.0047     0.0052
4000, [-16, 16]        0.00043    0.0011     0.0020     0.0043
=====================  =========  =========  =========  =========

The default is 4000 bins over [-16, 16] (width 0.008 logit; float32 probabilities saturate at a
logit of 16.6; 8,004 integers per class and site). Over 1,008 cases (3 draws of each of the
above) one pass was within 0.002 whenever the SD was 0.1 or more (worst 0.0019; SD 0.05: 0.0044).
A nearly constant model (all scores within ~0.3 logit) needs a narrower range: where the bound
exceeds 0.002, :func:`refine_bins` chooses one from the pooled counts of the first pass and a
second pass with it brought every one of the 1,008 cases within 0.00035. The bound was never
exceeded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from scipy.special import logit

from cxrfl.common.config import Config
from cxrfl.errors import ConfigError, UpdateRejected

_KEYS = ("bins", "positives", "negatives")
SEPARATOR = "|"
"""Between a class and one of its subgroups in a counting target (:mod:`cxrfl.clinical.subgroups`)."""


def split_name(name: str) -> tuple[str, str | None]:
    """A counting target -> (class, ``"<field>=<group>"``); a plain class -> (class, None).

    Args:
        name: a class, or ``"<class>|<field>=<group>"``.
    """
    cls, sep, group = name.rpartition(SEPARATOR)
    return (cls, group) if sep and "=" in group else (name, None)


@dataclass(frozen=True)
class BinSpec(Config):
    """The bins every site counts its scores in (sent by the server with the task).

    Args:
        low: logit of the lowest interior edge; scores below it fall in the open bin 0.
        high: logit of the highest edge; scores at or above it fall in the open bin ``n + 1``.
        n: number of equal-width interior bins.
    """

    SECTION: ClassVar[str] = "bins"
    low: float = -16.0
    high: float = 16.0
    n: int = field(default=4000, metadata={"ge": 1, "le": 1_000_000})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.high <= self.low:
            self.fail("high", f"must be above bins.low ({self.low}), got {self.high}")

    @property
    def size(self) -> int:
        """Number of bins, the two open ones included."""
        return self.n + 2

    def edges(self) -> np.ndarray:
        """The ``n + 1`` interior edges (logits); bin ``k`` holds ``edges[k-1] <= logit < edges[k]``."""
        return np.linspace(self.low, self.high, self.n + 1)

    def centres(self) -> np.ndarray:
        """One logit per bin: the interior bins' midpoints; ``low`` and ``high`` for the open bins."""
        e = self.edges()
        return np.concatenate([[self.low], (e[:-1] + e[1:]) / 2, [self.high]])

    def index(self, scores: np.ndarray) -> np.ndarray:
        """The bin of each probability (0 and 1 go to the open bins).

        Args:
            scores: probabilities in [0, 1].
        """
        with np.errstate(divide="ignore"):
            return np.searchsorted(self.edges(), logit(np.asarray(scores, dtype=float)), side="right")


@dataclass(frozen=True, eq=False)
class ScoreCounts:
    """One class's positives and negatives per bin (at one site, or merged over sites).

    Args:
        bins: the bins counted in.
        positives: [bins.size] number of positives per bin.
        negatives: [bins.size] number of negatives per bin.
    """

    bins: BinSpec
    positives: np.ndarray
    negatives: np.ndarray

    def __post_init__(self) -> None:
        for name in ("positives", "negatives"):
            a = np.asarray(getattr(self, name))
            if a.shape != (self.bins.size,) or not np.issubdtype(a.dtype, np.integer) or (a < 0).any():
                raise ValueError(f"{name} must be {self.bins.size} non-negative integers, got {a.dtype} {a.shape}")
            object.__setattr__(self, name, a.astype(np.int64))

    @property
    def n_pos(self) -> int:
        """Number of positives."""
        return int(self.positives.sum())

    @property
    def n_neg(self) -> int:
        """Number of negatives."""
        return int(self.negatives.sum())

    def to_dict(self) -> dict[str, Any]:
        """The JSON-safe message: the bins and two lists of ints."""
        return {"bins": self.bins.to_dict(), "positives": self.positives.tolist(), "negatives": self.negatives.tolist()}

    @classmethod
    def from_dict(cls, data: Any, *, bins: BinSpec, min_cell: int, where: str) -> ScoreCounts:
        """Check a received message and read it.

        Args:
            data: the message (as :meth:`to_dict` writes it).
            bins: the bins the server asked for.
            min_cell: the least number of positives and of negatives a site may send.
            where: who sent it, for messages (``"site-1, class Effusion"``).

        Raises:
            UpdateRejected: one line naming ``where`` and what is wrong.
        """
        if not isinstance(data, Mapping) or set(data) != set(_KEYS):
            got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise UpdateRejected(f"{where}: score counts must be a mapping with keys {list(_KEYS)}, got {got}")
        try:
            sent = BinSpec.from_dict(data["bins"])
        except ConfigError as exc:
            raise UpdateRejected(f"{where}: score counts have bad bins: {exc}") from None
        if sent != bins:
            raise UpdateRejected(
                f"{where}: score counts use bins {sent.to_dict()}, the server asked for {bins.to_dict()}"
            )
        arrays = {k: _int_list(data[k], k, bins.size, where) for k in ("positives", "negatives")}
        counts = cls(bins, arrays["positives"], arrays["negatives"])
        if _too_few(counts.n_pos, counts.n_neg, min_cell):
            raise UpdateRejected(
                f"{where}: score counts hold {counts.n_pos} positives and {counts.n_neg} "
                f"negatives, below the minimum cell size {min_cell}; a site sends nothing then"
            )
        return counts


def _too_few(n_pos: int, n_neg: int, min_cell: int) -> bool:
    """A class a site sends nothing for: no case at all, or a non-empty cell below ``min_cell`` (an empty
    one, e.g. no positive in the split, identifies nobody and its negatives still count in the pool)."""
    return n_pos + n_neg == 0 or 0 < n_pos < min_cell or 0 < n_neg < min_cell


def _int_list(value: Any, key: str, size: int, where: str) -> np.ndarray:
    """``value`` as an int64 array when it is a list of ``size`` non-negative ints, else UpdateRejected."""
    if not isinstance(value, (list, tuple)) or len(value) != size:
        got = f"length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
        raise UpdateRejected(f"{where}: score counts' {key} must be a list of {size} integers, got {got}")
    bad = next((v for v in value if type(v) is not int or v < 0 or v >= 2**62), None)
    if bad is not None:
        raise UpdateRejected(f"{where}: score counts' {key} must hold non-negative integers, found {bad!r}")
    return np.asarray(value, dtype=np.int64)


def count_scores(scores: np.ndarray, labels: np.ndarray, *, bins: BinSpec, min_cell: int) -> ScoreCounts | None:
    """Site side: count one class's scores per bin, or None when there are too few cases to send.

    Args:
        scores: [n] probabilities in [0, 1].
        labels: [n] 1 (positive), 0 (negative) or NaN (unknown: not counted).
        bins: the bins the server asked for.
        min_cell: the least number of positives and of negatives to send anything (>= 1).

    Returns:
        The counts, or None (the site sends nothing for this class) when there is no case, or when
        positives or negatives are more than none but fewer than ``min_cell``.
    """
    scores = np.asarray(scores, dtype=float).ravel()
    labels = np.asarray(labels, dtype=float).ravel()
    if scores.shape != labels.shape:
        raise ValueError(f"scores {scores.shape} and labels {labels.shape} differ in length")
    if isinstance(min_cell, bool) or not isinstance(min_cell, int) or min_cell < 1:
        raise ValueError(f"min_cell must be an integer >= 1, got {min_cell!r}")
    known = ~np.isnan(labels)
    scores, labels = scores[known], labels[known]
    if not np.isin(labels, (0.0, 1.0)).all():
        raise ValueError(f"labels must be 0, 1 or NaN, found {sorted(set(labels) - {0.0, 1.0})[:5]}")
    if not ((scores >= 0) & (scores <= 1)).all():
        raise ValueError(
            "scores must be probabilities in [0, 1] (apply the sigmoid to logits), found "
            f"{scores[~((scores >= 0) & (scores <= 1))][:3].tolist()}"
        )
    pos = labels == 1
    if _too_few(int(pos.sum()), int((~pos).sum()), min_cell):
        return None
    idx = bins.index(scores)
    return ScoreCounts(bins, np.bincount(idx[pos], minlength=bins.size), np.bincount(idx[~pos], minlength=bins.size))


def merge(counts: Sequence[ScoreCounts]) -> ScoreCounts:
    """Server side: the sum of the sites' counts of one class.

    Args:
        counts: the received counts (at least one), all with the same bins.
    """
    if not counts:
        raise ValueError("nothing to merge: no site sent counts for this class")
    bins = counts[0].bins
    if any(c.bins != bins for c in counts):
        raise ValueError(f"cannot merge counts over different bins: {sorted({str(c.bins.to_dict()) for c in counts})}")
    return ScoreCounts(
        bins, np.sum([c.positives for c in counts], axis=0), np.sum([c.negatives for c in counts], axis=0)
    )


def refine_bins(counts: ScoreCounts, *, mass: float = 0.999) -> BinSpec:
    """Narrower bins for a second pass, where the pooled scores of a class lie.

    The new range spans the bins that hold the central ``mass`` of all the pooled scores (both
    labels); the same number of bins. It never widens: a tail in an open bin keeps that limit.

    Args:
        counts: the pooled counts of the first pass.
        mass: fraction of the scores the new interior range must hold.
    """
    if not 0 < mass < 1:
        raise ValueError(f"mass must be in (0, 1), got {mass}")
    total = np.cumsum(counts.positives + counts.negatives)
    tail = (1 - mass) / 2 * total[-1]
    first = int(np.searchsorted(total, tail, side="right"))  # bin holding the lower quantile
    last = int(np.searchsorted(total, total[-1] - tail, side="left"))
    e = counts.bins.edges()
    low = e[first - 1] if first >= 1 else counts.bins.low
    high = e[last] if last <= counts.bins.n else counts.bins.high
    if high <= low:  # every score in one open bin: nothing to zoom into
        return counts.bins
    return BinSpec(low=float(low), high=float(high), n=counts.bins.n)


def count_request(classes: Sequence[str], bins: Mapping[str, BinSpec], min_cell: int) -> dict[str, Any]:
    """Server side: the ``counts`` entry of an evaluation task for one site.

    Args:
        classes: the site's classes being evaluated (never another site's).
        bins: class -> the bins to count it in.
        min_cell: the least number of positives and of negatives a site sends counts for.
    """
    return {"min_cell": int(min_cell), "bins": {c: bins[c].to_dict() for c in classes}}


def count_classes(
    scores: np.ndarray,
    labels: np.ndarray,
    classes: Sequence[str],
    request: Mapping[str, Any],
    *,
    groups: Mapping[str, np.ndarray] | None = None,
    site_min_cell: int = 1,
) -> dict[str, dict[str, Any] | None]:
    """Site side: answer a server's count request (:func:`count_request`) for the evaluated classes.

    Args:
        scores: [n, K] probabilities, columns in ``classes`` order.
        labels: [n, K] 1, 0 or NaN (not annotated).
        classes: the column names.
        request: ``{"min_cell": int, "bins": {target: BinSpec dict}}`` from the task; a target is a
            class or one of its subgroups (``"<class>|<field>=<group>"``, :mod:`cxrfl.clinical.subgroups`).
        groups: ``"<field>=<group>"`` -> [n] bool, which rows belong to it (a group not given: the
            site sends nothing for it).
        site_min_cell: the site's own floor: a request asking for less is raised to it.

    Returns:
        target -> :meth:`ScoreCounts.to_dict`, or None (too few cases: nothing sent), for every
        target of a class of ``classes`` the request names.

    Raises:
        ConfigError: a malformed request (one line; the site answers nothing).
    """
    if not isinstance(request, Mapping) or set(request) != {"min_cell", "bins"}:
        raise ConfigError(f"the server's count request must hold 'min_cell' and 'bins', got {request!r:.200}")
    min_cell, wanted = request["min_cell"], request["bins"]
    if isinstance(min_cell, bool) or not isinstance(min_cell, int) or min_cell < 1 or not isinstance(wanted, Mapping):
        raise ConfigError(
            f"bad count request: min_cell {min_cell!r} (an integer >= 1), bins of type "
            f"{type(wanted).__name__} (a mapping class -> bins)"
        )
    out: dict[str, dict[str, Any] | None] = {}
    for name in wanted:
        c, group = split_name(str(name))
        if c not in classes:
            continue
        j = list(classes).index(c)
        rows = np.ones(len(scores), bool) if group is None else (groups or {}).get(group)
        got = (
            None
            if rows is None
            else count_scores(
                scores[rows, j],
                labels[rows, j],
                bins=BinSpec.from_dict(wanted[name], where=f"bins of {name}"),
                min_cell=max(min_cell, site_min_cell),
            )
        )
        out[name] = None if got is None else got.to_dict()
    return out
