"""A model scored at many sites from binned counts, pooled per class over exactly the sites that label it.

The server side of every federated evaluation (the evaluation-only run of :mod:`cxrfl.fedeval` and the
final evaluation of a surgical training job): the settings (:class:`PooledEvaluation`), the counting
passes (:func:`count_at_sites`: a first pass in fixed bins, a second for the classes whose pooled AUROC
may differ from that of the raw scores by more than ``tolerance``), each site's answer checked whole
(:func:`parse_counts`) and the per-class report (:func:`pooled_report`, with a compact ROC curve:
:func:`compact_roc`). Transport-free: the caller sends the tasks. Nothing per image is involved; a
site's answer names only the classes it was asked.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from cxrfl.clinical.calibration import reliability
from cxrfl.clinical.counts import BinSpec, ScoreCounts, merge, refine_bins
from cxrfl.clinical.pooled import at_threshold, pooled_auroc, roc_curve
from cxrfl.clinical.subgroups import subgroup_names, subgroup_report
from cxrfl.common.config import Config
from cxrfl.errors import UpdateRejected

Counts = dict[str, dict[str, ScoreCounts | None]]
"""class -> site -> its counts (None: the site had too few cases and sent nothing)."""

CountPass = Callable[[Mapping[str, list[str]], Mapping[str, BinSpec]], Mapping[str, Mapping[str, Any]]]
"""Sends one counting pass: (site -> classes to count, class -> bins) -> site -> the answer's meta."""


@dataclass(frozen=True)
class PooledEvaluation(Config):
    """How sites count and the server pools.

    Args:
        min_cell: the least positives and negatives of a class a site sends counts for (else nothing).
        bins: the first pass's bins (:class:`cxrfl.clinical.counts.BinSpec`).
        tolerance: largest accepted bound on the binning error of a pooled AUROC; a class above it is
            counted again in bins fitted to its pooled scores (one second pass).
        level: confidence level of the intervals.
        threshold: the probability whose sensitivity and specificity are reported.
        subgroups: also count and pool every class by sex, age band and view
            (:mod:`cxrfl.clinical.subgroups`; about ten times the counts per site).
    """

    SECTION: ClassVar[str] = "pooled"
    min_cell: int = field(default=10, metadata={"ge": 1})
    bins: BinSpec = field(default_factory=BinSpec)
    tolerance: float = field(default=0.002, metadata={"gt": 0})
    level: float = field(default=0.95, metadata={"gt": 0, "lt": 1})
    threshold: float = field(default=0.5, metadata={"gt": 0, "lt": 1})
    subgroups: bool = False


def pooled(per: Mapping[str, ScoreCounts | None]) -> ScoreCounts | None:
    """The merged counts of the sites that sent some, when they hold positives and negatives (else None)."""
    sent = [v for v in per.values() if v is not None]
    out = merge(sent) if sent else None
    return out if out is not None and out.n_pos and out.n_neg else None


def compact_roc(counts: ScoreCounts, max_points: int = 200) -> dict[str, list[float]]:
    """The ROC curve of merged counts in at most ``max_points`` points from (0, 0) to (1, 1): aggregate rates
    only (rounded to 5 decimals). The points whose removal changes the curve least go first (Visvalingam-Whyatt:
    the triangle a point makes with its neighbours is what its removal takes from the trapezoid area), so the
    area stays the pooled AUROC within about 1e-4 (at most 9e-5 over 300 binormal classes, default bins).

    Args:
        counts: merged counts of one class (positives and negatives both present).
        max_points: the most points kept (>= 2).
    """
    x, y, _ = roc_curve(counts)
    left, right = list(range(-1, x.size - 1)), list(range(1, x.size + 1))

    def triangle(i: int) -> float:
        a, b = left[i], right[i]
        return abs((x[i] - x[a]) * (y[b] - y[a]) - (x[b] - x[a]) * (y[i] - y[a])) / 2

    area = {i: triangle(i) for i in range(1, x.size - 1)}
    heap = [(a, i) for i, a in area.items()]
    heapq.heapify(heap)
    while len(area) + 2 > max_points:
        a, i = heapq.heappop(heap)
        if area.get(i) != a:  # removed, or its area changed since it was pushed
            continue
        del area[i]
        right[left[i]], left[right[i]] = right[i], left[i]
        for j in (left[i], right[i]):
            if j in area:
                area[j] = triangle(j)
                heapq.heappush(heap, (area[j], j))
    keep = [0, *sorted(area), x.size - 1]
    return {"fpr": np.round(x[keep], 5).tolist(), "tpr": np.round(y[keep], 5).tolist()}


def parse_counts(
    site: str, meta: Mapping[str, Any], classes: Sequence[str], bins: Mapping[str, BinSpec], min_cell: int
) -> dict[str, ScoreCounts | None]:
    """A site's answer checked whole: counts for exactly the classes asked, each valid.

    Args:
        site: the answering site (named in the refusal).
        meta: its answer's meta (``metrics.counts``).
        classes: the classes it was asked to count.
        bins: class -> the bins it was asked to count in.
        min_cell: the minimum cell size asked.

    Raises:
        UpdateRejected: other classes than asked, or a malformed count.
    """
    metrics = meta.get("metrics")
    counts = metrics.get("counts") if isinstance(metrics, Mapping) else None
    if not isinstance(counts, Mapping) or set(counts) != set(classes):
        named = sorted(map(str, counts))[:5] if isinstance(counts, Mapping) else type(counts).__name__
        raise UpdateRejected(f"site {site}: answered counts for {named}, asked for {len(classes)} class(es)")
    return {
        c: None
        if counts[c] is None
        else ScoreCounts.from_dict(counts[c], bins=bins[c], min_cell=min_cell, where=f"site {site}, class {c}")
        for c in classes
    }


def count_at_sites(
    send: CountPass,
    evaluated: Mapping[str, list[str]],
    settings: PooledEvaluation,
    *,
    info: Callable[[str], None],
    warning: Callable[[str], None],
) -> Counts:
    """Every site's counts of its evaluated classes: a first pass in ``settings.bins``, then one more for
    the classes whose binning bound exceeds ``settings.tolerance``, in bins fitted to their pooled scores
    (it replaces the first only where the same sites answered).

    Args:
        send: sends one pass (see :data:`CountPass`).
        evaluated: site -> the classes it labels that the model has (sites with none get no task).
        settings: bins, minimum cell size and tolerance.
        info: progress lines.
        warning: a rejected answer, one line naming the site.
    """

    def one_pass(wanted: Mapping[str, list[str]], bins: Mapping[str, BinSpec]) -> Counts:
        out: Counts = {}
        for site, meta in send({s: v for s, v in wanted.items() if v}, bins).items():
            try:
                got = parse_counts(site, meta, wanted[site], bins, settings.min_cell)
            except UpdateRejected as exc:
                warning(f"rejected the counts of site {site}: {exc}")
                continue
            for c, value in got.items():
                out.setdefault(c, {})[site] = value
        return out

    if settings.subgroups:
        evaluated = {s: [*ev, *subgroup_names(ev)] for s, ev in evaluated.items()}
    bins = {c: settings.bins for ev in evaluated.values() for c in ev}
    counts = one_pass(evaluated, bins)
    fitted = {
        c: refine_bins(p)
        for c, per in counts.items()
        if (p := pooled(per)) is not None and pooled_auroc(p).binning_bound > settings.tolerance
    }
    if fitted:
        info(f"{len(fitted)} class(es) counted again in bins fitted to their pooled scores")
        again = one_pass({s: [c for c in ev if c in fitted] for s, ev in evaluated.items()}, {**bins, **fitted})
        for c in fitted:
            if set(again.get(c, {})) == set(counts[c]):
                counts[c] = again[c]
    return counts


def pooled_report(
    classes: Sequence[str],
    evaluated: Mapping[str, list[str]],
    counts: Counts,
    settings: PooledEvaluation,
    info: Callable[[str], None],
) -> dict[str, Any]:
    """Per class the pooled AUROC with its interval and a compact ROC curve, the sensitivity and specificity
    at ``threshold``, the reliability diagram and ECE, and which sites were pooled or sent nothing; one log
    line per class.

    Args:
        classes: the model's classes (the report's rows).
        evaluated: site -> the classes it was asked to count.
        counts: :func:`count_at_sites`' result.
        settings: interval level and threshold.
        info: one line per pooled class.
    """
    rows = {}
    for c in classes:
        per = counts.get(c, {})
        sent = {s: v for s, v in per.items() if v is not None}
        entry: dict[str, Any] = {
            "sites_labelling": sorted(s for s, ev in evaluated.items() if c in ev),
            "sites_pooled": sorted(sent),
            "sites_withheld": sorted(set(per) - set(sent)),
        }
        merged = pooled(per)
        if merged is None:
            entry["auroc"] = None  # no site sent counts, or the pooled split has one label only
        else:
            auroc, diagram = pooled_auroc(merged, level=settings.level), reliability(merged)
            entry.update(
                auroc=auroc.to_dict(),
                roc=compact_roc(merged),
                ece=diagram.ece,
                reliability=diagram.to_dict(),
                at_threshold=at_threshold(merged, settings.threshold, level=settings.level).to_dict(),
                bins=merged.bins.to_dict(),
            )
            info(
                f"{c}: pooled AUROC {auroc.value:.3f} ({auroc.low:.3f}-{auroc.high:.3f}) over "
                f"{len(sent)} site(s), {auroc.n_pos} positives / {auroc.n_neg} negatives, ECE {diagram.ece:.3f}"
            )
        rows[c] = entry
    values = [e["auroc"]["value"] for e in rows.values() if e["auroc"] is not None]
    audit = {}
    if settings.subgroups:
        targets = subgroup_names(classes)
        by_target = {t: pooled(counts.get(t, {})) for t in targets}
        audit = {"subgroups": subgroup_report(classes, by_target, level=settings.level)}
    return {
        **audit,
        "min_cell": settings.min_cell,
        "level": settings.level,
        "threshold": settings.threshold,
        "classes": rows,
        "mean_auroc": float(np.mean(values)) if values else None,
        "not_labelled": [c for c, e in rows.items() if not e["sites_labelling"]],
    }
