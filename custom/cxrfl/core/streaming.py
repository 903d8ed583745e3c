"""One round's results, validated whole as they arrive and averaged at the end: :class:`StreamingFedAvg`.

Part of the shared federated core (framework-free). Used by
:class:`cxrfl.surgical.round_aggregator.RoundAggregator` (which stitches the head rows itself) and
FedFew's rounds (:meth:`cxrfl.fedfew.rounds.FederatedRounds.round_stream`); the averaging is
:func:`cxrfl.core.fedavg.fedavg_keys`. Each accepted result is also compared with the model it was sent
(:func:`cxrfl.core.update_change.compare_to_sent`): :attr:`StreamingFedAvg.changes`, for the round record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from cxrfl.core.fedavg import check_options, clipping_reference, fedavg_keys, site_weights
from cxrfl.core.running_sum import RunningSum
from cxrfl.core.update_change import compare_to_sent
from cxrfl.core.updates import (
    Array,
    ParsedUpdate,
    SampleCounts,
    as_numpy,
    expected_dtypes,
    first_nonfinite,
    normalize_shapes,
    parse_update,
    shape_of,
)
from cxrfl.errors import UpdateRejected
from cxrfl.nn.threads import single_threaded


class StreamingFedAvg:
    """One round's results, validated whole as they arrive and averaged at the end.

    A result is accepted or rejected atomically: it is parsed and checked whole (fields, dtypes,
    shapes, running variances, sample counts, and NaN/Inf) before any of it touches the sum; a
    rejection keeps one reason per site in :attr:`rejected`. For the plain mean each accepted result
    is added to a running sum while it is checked for NaN/Inf and its summed arrays are dropped, so
    the aggregator holds one model-sized sum however many sites answer; a robust mode keeps the
    results whole and takes their median or clips them at the end (:func:`cxrfl.core.fedavg.fedavg_keys`).
    With a reference (:meth:`expect`), :attr:`changes` keeps, per accepted site, its result's share of
    unchanged values and the L2 norm of its change from that reference, until :meth:`reset`.

    Args:
        weighting: one of :data:`cxrfl.core.fedavg.WEIGHTINGS`.
        robust: one of :data:`cxrfl.core.fedavg.ROBUST_MODES` (a clipping one needs the reference of :meth:`expect`).
        clip_norm: the clipping norm (None: :data:`cxrfl.core.fedavg.ADAPTIVE`).
        head_prefix: the state-dict prefix of a head (validated per class, kept in the accepted
            results and never averaged here: the caller stitches it); None: results have no head.
        drop: keys left out of the results (neither needed nor checked nor averaged: local BatchNorm under FedBN).
        counts: the sample counts each site may report (kept over rounds by the caller); None: not checked.
    """

    def __init__(
        self,
        *,
        weighting: str = "uniform",
        robust: str | None = None,
        clip_norm: float | None = None,
        head_prefix: str | None = None,
        drop: Iterable[str] = (),
        counts: SampleCounts | None = None,
    ) -> None:
        check_options(weighting, robust, clip_norm)
        self.weighting, self.robust, self.clip_norm = weighting, robust, clip_norm
        self.head_prefix = head_prefix
        self.drop = frozenset(drop)
        self.counts = counts
        self.expected_shapes: Mapping[str, tuple[int, ...]] | None = None
        self.announced: dict[str, list[str]] = {}
        self.reference: Mapping[str, Array] | None = None
        self.dtypes: dict[str, str] | None = None  # key -> dtype every result must have
        self.accepted: list[ParsedUpdate] = []
        self.rejected: dict[str, str] = {}
        self.changes: dict[str, tuple[float, float]] = {}  # site -> (unchanged share, update norm)
        self.running: RunningSum | None = None
        self.dropped = False  # some accepted result's summed arrays were dropped

    def expect(
        self,
        shapes: Mapping[str, Sequence[int]] | None,
        *,
        reference: Mapping[str, Array] | None = None,
        announced: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Set what valid results look like for the next aggregation (and forget earlier results).

        Args:
            shapes: parameter name -> shape every site must send (head entries only fix the head's inputs);
                None: those of the first accepted result.
            reference: the previous global parameters: results must have its dtypes (without it: those of
                the first accepted result); clipped updates are measured from it.
            announced: site -> the classes it announced (head rows for others are rejected).
        """
        self.reset()
        self.expected_shapes = normalize_shapes(shapes) if shapes is not None else None  # once, not per result
        self.announced = {s: list(c) for s, c in (announced or {}).items()}
        self.reference = reference
        self.dtypes = expected_dtypes(reference) if reference is not None else None

    @property
    def accepted_sites(self) -> list[str]:
        """The sites whose results were accepted since :meth:`expect`."""
        return [p.site for p in self.accepted]

    @single_threaded
    def accept(self, update: Mapping[str, Any]) -> ParsedUpdate | None:
        """Validate one site's result whole and keep it (the plain mean: sum it and drop its summed arrays).

        Args:
            update: ``{"site", "classes" (with a head), "params", "num_samples"}`` (:mod:`cxrfl.core.updates`).

        Returns:
            The accepted result (its summed arrays dropped), or None: rejected, the reason in :attr:`rejected`.
        """
        site = str(update.get("site") or "unknown-site") if isinstance(update, Mapping) else "unknown-site"
        streaming = self.robust is None  # the plain mean: sum while checking, each array read once
        try:  # the whole result is checked before any of it is summed
            parsed = parse_update(
                update,
                expected_shapes=self.expected_shapes,
                head_prefix=self.head_prefix,
                announced_classes=self.announced.get(site) if self.announced else None,
                check_finite=not streaming,
                drop=self.drop,
                dtypes=self.dtypes,
            )
            if self.counts is not None:
                self.counts.check(site, parsed.num_samples)
            if streaming:
                self._add_checked(parsed)
        except UpdateRejected as exc:
            self.rejected[site] = str(exc)
            return None
        if self.counts is not None:
            self.counts.note(site, parsed.num_samples)
        if self.dtypes is None:
            self.dtypes = expected_dtypes(parsed.params)
        if self.expected_shapes is None:
            self.expected_shapes = normalize_shapes({k: shape_of(v) for k, v in parsed.params.items()})
        change = compare_to_sent(parsed.params, self.reference) if self.reference is not None else None
        if change is not None:
            self.changes[site] = change
        if streaming and self.running is not None and self.running.usable:  # summed: keep the head only
            summed = set(self.running.keys)
            kept = {k: v for k, v in parsed.params.items() if k not in summed}
            parsed = dataclasses.replace(parsed, params=kept)
            self.dropped = True
        self.accepted.append(parsed)
        return parsed

    def _keys(self, params: Mapping[str, Any]) -> list[str]:
        """The keys of ``params`` that are averaged here (no head)."""
        head = self.head_prefix
        return [k for k in params if head is None or not k.startswith(head)]

    def _add_checked(self, parsed: ParsedUpdate) -> None:
        """NaN/Inf check of a structurally valid result, adding it to the running sum on the way."""
        keys = self._keys(parsed.params)
        if self.running is None:
            self.running = RunningSum(keys)
        running = self.running
        if running.usable and running.keys != keys:  # no expected shapes given: aggregation will say why
            running.usable = False
        weight = site_weights([parsed], self.weighting)[0]
        bad = (
            running.add(parsed.site, parsed.params, weight, check_finite=True)
            if running.usable
            else first_nonfinite(parsed.params.items())
        )
        if bad is not None:
            raise UpdateRejected(f"site {parsed.site}: non-finite values (NaN or Inf) in {bad!r}")

    def _summed(self) -> RunningSum | None:
        """The running sum when it holds exactly the accepted results with their weights (else None)."""
        running = self.running
        weights = site_weights(self.accepted, self.weighting)
        if running is None or not running.usable or running.added != list(zip(self.accepted_sites, weights)):
            return None
        return running

    @single_threaded
    def aggregate(self) -> dict[str, np.ndarray]:
        """The FedAvg of the accepted results' averaged keys (no head), as numpy arrays; then forget them.

        Raises:
            UpdateRejected: no accepted result, two results of one site, or a site's values make the mean
                non-finite.
            ValueError: finite values whose mean overflows, a clipping mode without a reference, or summed
                arrays that were dropped but the running sum is not theirs.
        """
        try:
            parsed = self.accepted
            if not parsed:
                raise UpdateRejected("no valid site result to aggregate")
            sites = self.accepted_sites
            twice = next((s for i, s in enumerate(sites) if s in sites[:i]), None)
            if twice is not None:
                raise UpdateRejected(f"site {twice}: sent more than one update this round")
            running = self._summed()
            if running is None and self.dropped:
                raise ValueError("the results' summed arrays were dropped, but the running sum is not theirs")
            keys = list(running.keys) if running is not None else self._keys(parsed[0].params)
            shapes = {k: shape_of(parsed[0].params[k]) for k in keys} if running is None else {}
            reference = clipping_reference(self.robust, len(parsed), self.reference, shapes)
            weights = site_weights(parsed, self.weighting)
            body = fedavg_keys(
                parsed,
                keys,
                weights,
                robust=self.robust,
                clip_norm=self.clip_norm,
                reference=reference,
                running=running,
            )
            return {k: as_numpy(v) for k, v in body.items()}
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget the accepted results and rejections of the current round."""
        self.accepted = []
        self.rejected = {}
        self.changes = {}
        self.running = None
        self.dropped = False
