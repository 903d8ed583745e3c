"""What a server does with one round's results as they arrive: :class:`RoundAggregator`.

Built on the shared core's streaming aggregator (:class:`cxrfl.core.streaming.StreamingFedAvg`): each
result is validated as a whole (one rejection line per bad result, :mod:`cxrfl.core.updates`:
fields, dtypes, shapes, sample counts) before any of it touches the sum; for the plain mean its
feature extractor is added to a running sum (:class:`cxrfl.core.running_sum.RunningSum`) and
dropped, and at the end the head rows are stitched by
:func:`cxrfl.surgical.aggregation.surgical_aggregate` (``local`` heads: the core's FedAvg of the
feature extractor alone). Against the model it sent, the core measures each accepted result's update
norm and share of unchanged values (:mod:`cxrfl.core.update_change`); the share is about the filter's
percentile when a site's privacy filter zeroes small changes (:mod:`cxrfl.fl.privacy`), near 0 after
ordinary local training, 1 for the feature extractor of a head warm-up (frozen there). Used by
:class:`cxrfl.surgical.server.SurgicalServer` and, inside NVFlare's own workflows, by
:class:`cxrfl.fl.aggregator.SurgicalAggregator`. Validation and aggregation run on one torch
thread (:func:`cxrfl.nn.threads.single_threaded`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cxrfl.core.streaming import StreamingFedAvg
from cxrfl.core.update_change import outlying_norms
from cxrfl.core.updates import HEAD_PREFIX, MAX_NUM_SAMPLES, Array, SampleCounts
from cxrfl.errors import UpdateRejected
from cxrfl.nn.threads import single_threaded
from cxrfl.surgical.aggregation import check_options, surgical_aggregate
from cxrfl.surgical.head_modes import check_modes, drop_head

log = logging.getLogger(__name__)


@dataclass
class RoundResult:
    """One aggregated round.

    Args:
        params: the global parameters (``local`` heads: the feature extractor only).
        classes: the global head's class order ([] for ``local`` heads).
        contributors: class -> the sites whose rows were averaged into it.
        sites: the sites whose results were aggregated.
        changes: site -> (share of its result's floating-point values equal to the model it was sent, the
            L2 norm of its change from that model), over the parameters both hold with the same shape
            (:func:`cxrfl.core.update_change.compare_to_sent`; none without a reference).
    """

    params: dict[str, Array]
    classes: list[str]
    contributors: dict[str, list[str]]
    sites: list[str]
    changes: dict[str, tuple[float, float]] = field(default_factory=dict)


class RoundAggregator:
    """One round's results, validated as they arrive and aggregated at the end.

    For the plain mean (``robust`` off) each accepted result's feature extractor is added to a
    running sum while it is checked for NaN/Inf and then dropped (:class:`StreamingFedAvg`): the
    aggregator keeps one model-sized sum and the accepted head rows, however many sites answer
    (a server that streams its answers, :class:`cxrfl.common.transport.Send`, holds one site's
    update at a time); the head rows are stitched by :meth:`aggregate`.

    Args:
        weighting: ``uniform`` (the papers) or ``samples`` (weighted by ``num_samples``).
        batchnorm: ``fedavg``, ``fedbn`` or ``fedbn+`` (see :func:`surgical_aggregate`).
        bn_keys: BatchNorm parameter and buffer names (:func:`cxrfl.nn.models.batchnorm_keys`).
        robust: None, ``median`` or ``clip`` (see :func:`surgical_aggregate`). Both need the
            reference of :meth:`expect` (the previous global model, or the initial feature
            extractor of a warm-up): an aggregation without one fails rather than fall back to the mean.
        clip_norm: update norm bound for ``clip`` and ``median`` (groups of fewer than 3 sites); None:
            each round's lower median update norm.
        head_mode: ``surgical``/``union`` (results carry head rows) or ``local`` (results carry
            the feature extractor only, head entries are ignored; the aggregate has no head).
        head_prefix: state-dict prefix of the classification head.
        max_num_samples: the largest ``num_samples`` accepted; a site's later results must also
            report about the count of its first accepted one (:class:`SampleCounts`).
        warning: where each rejection line goes.
    """

    def __init__(
        self,
        *,
        weighting: str = "uniform",
        batchnorm: str = "fedavg",
        bn_keys: Sequence[str] = (),
        robust: str | None = None,
        clip_norm: float | None = None,
        head_mode: str = "surgical",
        head_prefix: str = HEAD_PREFIX,
        max_num_samples: int = MAX_NUM_SAMPLES,
        warning: Callable[[str], None] = log.warning,
    ) -> None:
        check_options(weighting, batchnorm, robust, clip_norm)
        check_modes(head_mode, "negative", batchnorm)
        self.weighting = weighting
        self.batchnorm = batchnorm
        self.bn_keys = tuple(bn_keys)
        self.robust = robust
        self.clip_norm = clip_norm
        self.head_mode = head_mode
        self.head_prefix = head_prefix
        self.warning = warning
        self.stream = StreamingFedAvg(
            weighting=weighting,
            robust=robust,
            clip_norm=clip_norm,
            head_prefix=None if head_mode == "local" else head_prefix,
            drop=self.bn_keys if batchnorm != "fedavg" else (),
            counts=SampleCounts(max_num_samples),  # for the whole run, not one round
        )
        self.classes: list[str] | None = None
        self.reference: Mapping[str, Array] | None = None

    def expect(
        self,
        shapes: Mapping[str, Sequence[int]] | None,
        announced: Mapping[str, Sequence[str]] | None = None,
        classes: Sequence[str] | None = None,
        reference: Mapping[str, Array] | None = None,
    ) -> None:
        """Set what valid results look like for the next aggregation (and forget earlier results).

        Args:
            shapes: non-head parameter name -> shape every site must send.
            announced: site -> the classes it announced; rows for other classes are rejected.
            classes: the global class order; a class no valid site sent keeps its ``reference`` row.
            reference: the previous global parameters (needed with ``classes`` and by ``robust``; a
                warm-up's: the initial feature extractor); results must have its dtypes (without
                it: those of the first accepted result).
        """
        local = self.head_mode == "local"
        if local and reference is not None:
            reference = drop_head(reference, self.head_prefix)
        self.stream.expect(shapes, reference=reference, announced=None if local else announced)
        self.classes = None if local or classes is None else list(classes)
        self.reference = reference

    @property
    def rejected(self) -> dict[str, str]:
        """site -> why its result of the current round was rejected."""
        return self.stream.rejected

    @single_threaded
    def accept(self, update: Mapping[str, Any]) -> bool:
        """Validate one site's result and keep it for aggregation (its head rows; with the plain
        mean its feature extractor goes into the running sum).

        Args:
            update: ``{"site", "classes", "params", "num_samples"}``.

        Returns:
            True if accepted; False if rejected (one warning line with the site and reason,
            kept in :attr:`rejected`).
        """
        update = dict(update)
        site = str(update.get("site") or "unknown-site")
        if self.head_mode == "local" and isinstance(update.get("params"), Mapping):
            update["params"] = drop_head(update["params"], self.head_prefix)
        update["classes"] = list(update.get("classes") or [])
        update["params"] = update.get("params") or {}
        if self.stream.accept(update) is None:
            self.warning(f"rejected result: {self.stream.rejected[site]}")
            return False
        return True

    @property
    def accepted_sites(self) -> list[str]:
        """The sites whose results were accepted since :meth:`expect`."""
        return self.stream.accepted_sites

    def contributors(self) -> dict[str, list[str]]:
        """class -> the sites whose rows were averaged into it (accepted results only)."""
        out: dict[str, list[str]] = {}
        for p in self.stream.accepted:
            for c in p.classes:
                out.setdefault(c, []).append(p.site)
        return {c: sorted(s) for c, s in sorted(out.items())}

    @single_threaded
    def aggregate(self) -> RoundResult:
        """Stitch the accepted results (and forget them).

        Raises:
            UpdateRejected: no accepted result, or a site's values make the mean non-finite.
            ValueError: finite values whose mean overflows, or a class nobody sent and no reference.
        """
        sites, changes = sorted(self.accepted_sites), dict(self.stream.changes)
        try:
            if not self.stream.accepted:
                raise UpdateRejected("no valid site result to aggregate")
            for line in outlying_norms({s: norm for s, (_, norm) in changes.items()}):
                self.warning(line)
            if self.head_mode == "local":
                return RoundResult(dict(self.stream.aggregate()), [], {}, sites, changes)
            params, classes = surgical_aggregate(
                [
                    {"site": p.site, "classes": p.classes, "params": p.params, "num_samples": p.num_samples}
                    for p in self.stream.accepted
                ],
                head_prefix=self.head_prefix,
                classes=self.classes,
                weighting=self.weighting,
                batchnorm=self.batchnorm,
                bn_keys=self.bn_keys,
                robust=self.robust,
                clip_norm=self.clip_norm,
                reference=self.reference,
                running=self.stream.running,
            )
            return RoundResult(params, classes, self.contributors(), sites, changes)
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget the accepted results and rejections of the current round."""
        self.stream.reset()
