"""Head-agnostic FedAvg: weighting, robust options (median, clipped updates), streaming rounds.

Part of the shared federated core (framework-free, no NVFlare import). Every function averages the
keys it is given; a method's head (surgical aggregation's per-class rows) is its own business:

- :func:`check_options`, :func:`site_weights`: the options and each site's weight;
- :func:`fedavg_keys`: the mean (streaming through a :class:`cxrfl.core.running_sum.RunningSum`
  when one was fed), the coordinate-wise median, or the mean of updates clipped to a norm;
  :func:`fedavg`: the same for one round's head-less updates given at once (surgical's ``local`` heads);
- :class:`cxrfl.core.streaming.StreamingFedAvg` (its own module): one round's results, each validated
  whole as it arrives before any of it touches the sum, and aggregated here at the end.

Numerics of the mean: one pass over the sites, adding each site's tensors times its weight into one
running sum per key (float32, float64 for float64 inputs; small arrays are added as one flat array
per dtype), then dividing by the total weight, as NVFlare's FedAvg does; the extra memory is about
one model; non-finite inputs are detected on those sums (NaN/Inf propagate) and only then traced
back to the site. Integer buffers (BatchNorm's ``num_batches_tracked``) get the weighted mean
rounded to the nearest integer, in their dtype. Aggregation runs on one torch thread
(:func:`cxrfl.nn.threads.single_threaded`), as NVFlare's numpy FedAvg does: oversubscribed threads
made them 17x slower on a busy machine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cxrfl.core.running_sum import RunningSum
from cxrfl.core.update_change import change_sq
from cxrfl.core.updates import (
    Array,
    ParsedUpdate,
    all_finite,
    as_numpy,
    as_tensor,
    expected_dtypes,
    first_nonfinite,
    parse_round,
    shape_of,
)
from cxrfl.errors import UpdateRejected
from cxrfl.nn.threads import single_threaded

WEIGHTINGS = ("uniform", "samples")
"""``uniform``: every site counts the same (the papers); ``samples``: weighted by ``num_samples``."""
ROBUST_MODES = (None, "median", "clip")
"""None: the mean; ``median``: coordinate-wise median; ``clip``: updates clipped to a norm."""
MEDIAN_MIN_SITES = 3
"""Fewest contributors a coordinate-wise median outvotes one hostile site with (the median of two is
their mean): a group with fewer (the feature extractor of a round with 1-2 results, the head row of a
class 1-2 sites hold) is aggregated as ``clip`` does, with the same ``clip_norm``."""
ADAPTIVE = None
"""``clip_norm`` None with a robust mode: the bound of a round is the lower median norm of that round's
updates (feature extractor: over the sites; head: over every row a site sent), so it follows the model's
scale without tuning and a minority of scaled updates cannot raise it (of two, the smaller bounds both)."""


def lower_median(values: Sequence[float]) -> float:
    """The lower median (an element of ``values``: of two, the smaller).

    Args:
        values: non-empty numbers.
    """
    return float(np.quantile(values, 0.5, method="lower"))


def check_options(weighting: str, robust: str | None, clip_norm: float | None) -> None:
    """Raise ValueError for FedAvg options that do not fit together.

    Args:
        weighting: one of :data:`WEIGHTINGS`.
        robust: one of :data:`ROBUST_MODES`.
        clip_norm: a positive bound, or None (:data:`ADAPTIVE`), with ``robust`` ``clip`` or ``median`` (see
            :data:`MEDIAN_MIN_SITES`); None without ``robust``.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {list(WEIGHTINGS)}, got {weighting!r}")
    if robust not in ROBUST_MODES:
        raise ValueError(f"robust must be one of {list(ROBUST_MODES)}, got {robust!r}")
    if robust == "median" and weighting != "uniform":
        raise ValueError("robust='median' is an unweighted median; use weighting='uniform'")
    if robust is None and clip_norm is not None:
        raise ValueError("clip_norm is only used with robust='clip' or robust='median'")
    if clip_norm is not None and (
        isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or not 0 < clip_norm < math.inf
    ):
        raise ValueError(
            f"clip_norm must be a positive number or null (the median norm of each round's updates), got {clip_norm!r}"
        )


def site_weights(parsed: Sequence[ParsedUpdate], weighting: str) -> list[float]:
    """Each update's weight: 1, or its ``num_samples`` with ``weighting="samples"``.

    Args:
        parsed: the round's updates.
        weighting: one of :data:`WEIGHTINGS`.
    """
    return [float(p.num_samples) if weighting == "samples" else 1.0 for p in parsed]


def clip_scale(norm: float, bound: float) -> float:
    """Factor that brings an update of ``norm`` to norm <= ``bound``.

    Args:
        norm: the update's L2 norm.
        bound: the clipping norm.
    """
    return min(1.0, bound / norm) if norm > 0 else 1.0


def _update_norm(p: ParsedUpdate, keys: Sequence[str], ref: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of the site's update (params - reference) over its float ``keys``."""
    sq = 0.0
    for k in keys:
        t = as_tensor(p.params[k])
        if t.is_floating_point():
            part = change_sq(t, ref[k])
            if not math.isfinite(part):
                raise UpdateRejected(f"site {p.site}: non-finite values (NaN or Inf) in {k!r}")
            sq += part
    return math.sqrt(sq)


def _raise_for_bad_key(key: str, parsed: Sequence[ParsedUpdate]) -> None:
    """Name the site behind a non-finite aggregate of ``key``."""
    bad = [p.site for p in parsed if key in p.params and not all_finite(as_tensor(p.params[key]))]
    if not bad:
        raise ValueError(f"the mean of {key!r} is not finite: values at the limit of the float range")
    also = f" (also sites {bad[1:]})" if len(bad) > 1 else ""
    raise UpdateRejected(f"site {bad[0]}: non-finite values (NaN or Inf) in {key!r}{also}")


def weighted_mean(
    parsed: Sequence[ParsedUpdate],
    keys: Sequence[str],
    weights: Sequence[float],
    ref: Mapping[str, torch.Tensor] | None,
    clip_norm: float | None,
    running: RunningSum | None = None,
) -> dict[str, torch.Tensor]:
    """(Weighted) mean of ``keys``, streaming; with ``ref``, of deltas clipped to ``clip_norm``.

    Args:
        parsed: the round's updates.
        keys: the keys to average.
        weights: one per update.
        ref: key -> the reference tensor the deltas are taken from (None: no clipping).
        clip_norm: the clipping norm (None: :data:`ADAPTIVE`).
        running: these updates' sum, already accumulated with these weights (no clipping); consumed.
    """
    total = sum(weights)
    clipping = ref is not None
    if running is None:
        running = RunningSum(keys)
        norms = [_update_norm(p, keys, ref) for p in parsed] if ref is not None else []
        bound = clip_norm if clip_norm is not None else lower_median(norms) if norms else 0.0
        for i, (w, p) in enumerate(zip(weights, parsed)):
            scale = clip_scale(norms[i], bound) if clipping else 1.0
            running.add(p.site, p.params, w * scale, int_weight=w)
    out = running.sums()
    running.usable = False  # its sums become the mean, in place
    floats = [k for k in keys if running.dtype(k).is_floating_point]
    for k in keys:
        out[k].div_(total)
    if ref is not None:
        kept = 1.0 - sum(w for _, w in running.added) / total
        for k in floats:
            out[k].add_(ref[k], alpha=kept)  # = ref + sum_i c_i (x_i - ref), c_i = w_i scale_i / total
    bad = first_nonfinite((k, out[k]) for k in floats)
    if bad is not None:
        _raise_for_bad_key(bad, parsed)
    return {
        k: (out[k] if running.dtype(k).is_floating_point else torch.round(out[k])).to(running.dtype(k)) for k in keys
    }


def coordinate_median(parsed: Sequence[ParsedUpdate], keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Coordinate-wise (unweighted) median of ``keys``; integer buffers rounded, in their dtype.

    Args:
        parsed: the round's updates.
        keys: the keys to take the median of.
    """
    out: dict[str, np.ndarray] = {}
    for k in keys:
        stack = np.stack([as_numpy(p.params[k]) for p in parsed])
        med = np.median(stack, axis=0)
        dtype = stack.dtype
        out[k] = (np.rint(med) if not np.issubdtype(dtype, np.floating) else med).astype(dtype)
    return out


def reference_tensors(reference: Mapping[str, Array], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The reference's tensor of every key in ``shapes`` (what clipped updates are measured from).

    Args:
        reference: the previous global parameters.
        shapes: key -> the shape the reference must have.

    Raises:
        ValueError: a key missing from ``reference`` or of another shape.
    """
    out: dict[str, torch.Tensor] = {}
    for k, shape in shapes.items():
        if k not in reference or shape_of(reference[k]) != shape:
            found = shape_of(reference[k]) if k in reference else "nothing"
            raise ValueError(f"reference must hold {k!r} with shape {shape}, found {found}")
        out[k] = as_tensor(reference[k])
    return out


def clipping_reference(
    robust: str | None, n_updates: int, reference: Mapping[str, Array] | None, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor] | None:
    """The reference tensors clipped updates are measured from, or None when nothing is clipped.

    Updates are clipped with ``robust="clip"``, and with ``median`` over fewer than :data:`MEDIAN_MIN_SITES`.

    Args:
        robust: one of :data:`ROBUST_MODES`.
        n_updates: how many updates are aggregated.
        reference: the previous global parameters (None: none given).
        shapes: key -> shape of the keys that are clipped.

    Raises:
        ValueError: updates are clipped but there is no reference, or it lacks a key or has another shape.
    """
    few = robust == "median" and n_updates < MEDIAN_MIN_SITES
    if robust != "clip" and not few:
        return None
    if reference is None:
        raise ValueError(
            f"robust='median' over fewer than {MEDIAN_MIN_SITES} updates clips them: pass reference="
            if few
            else "robust='clip' needs reference= (the previous global params)"
        )
    return reference_tensors(reference, shapes)


@single_threaded
def fedavg(
    updates: Iterable[Mapping[str, Any]],
    *,
    weighting: str = "uniform",
    robust: str | None = None,
    clip_norm: float | None = None,
    reference: Mapping[str, Array] | None = None,
    drop: Iterable[str] = (),
) -> dict[str, np.ndarray]:
    """FedAvg of one round's head-less updates, given all at once (:class:`StreamingFedAvg`: as they arrive).

    Args:
        updates: update mappings without a head (``site``, ``params``, ``num_samples``; ``classes`` not read).
        weighting: one of :data:`WEIGHTINGS`.
        robust: one of :data:`ROBUST_MODES`.
        clip_norm: the clipping norm (None: :data:`ADAPTIVE`).
        reference: the previous global parameters (dtypes; what clipped updates are measured from).
        drop: keys left out (neither needed nor averaged: local BatchNorm under FedBN).

    Returns:
        key -> the aggregate, as numpy arrays, in the first update's key order.

    Raises:
        UpdateRejected: an update fails its checks, two updates name one site, or a site's values make the
            mean non-finite.
        ValueError: bad options, no updates, a clipping mode without a reference, or a mean that overflows.
    """
    check_options(weighting, robust, clip_norm)
    parsed = parse_round(
        updates,
        head_prefix=None,
        announced=None,
        check_finite=robust == "median",
        drop=frozenset(drop),
        dtypes=expected_dtypes(reference) if reference is not None else {},
    )
    keys = list(parsed[0].params)
    ref = clipping_reference(robust, len(parsed), reference, {k: shape_of(parsed[0].params[k]) for k in keys})
    weights = site_weights(parsed, weighting)
    body = fedavg_keys(parsed, keys, weights, robust=robust, clip_norm=clip_norm, reference=ref)
    return {k: as_numpy(v) for k, v in body.items()}


def fedavg_keys(
    parsed: Sequence[ParsedUpdate],
    keys: Sequence[str],
    weights: Sequence[float],
    *,
    robust: str | None,
    clip_norm: float | None = None,
    reference: Mapping[str, torch.Tensor] | None = None,
    running: RunningSum | None = None,
) -> dict[str, Array]:
    """FedAvg of ``keys``: the (weighted) mean, the coordinate-wise median, or the mean of clipped updates.

    Args:
        parsed: the round's updates.
        keys: the keys to aggregate (the others are left to the caller).
        weights: one per update (:func:`site_weights`).
        robust: one of :data:`ROBUST_MODES`; ``median`` over fewer than :data:`MEDIAN_MIN_SITES` updates clips.
        clip_norm: the clipping norm (None: :data:`ADAPTIVE`, the lower median of the updates' norms).
        reference: key -> reference tensor (:func:`reference_tensors`); needed whenever updates are clipped.
        running: the plain mean's sum of exactly these updates and weights, fed as they arrived (consumed).

    Returns:
        key -> torch tensors (mean) or numpy arrays (median).
    """
    if robust == "median" and len(parsed) >= MEDIAN_MIN_SITES:
        return dict(coordinate_median(parsed, keys))
    if robust is not None and reference is None:
        raise ValueError(f"robust={robust!r} clips updates here and needs the reference (the previous global params)")
    clipping = robust is not None
    return dict(
        weighted_mean(parsed, keys, weights, reference if clipping else None, clip_norm, None if clipping else running)
    )
