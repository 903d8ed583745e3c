"""Surgical aggregation: FedAvg of the feature extractor, class-wise averaging of the head.

Framework-free (no NVFlare import): parameters are numpy arrays or torch tensors and come back
as the same kind (torch results are on the CPU). Updates are the mappings of
:mod:`cxrfl.surgical.validation` (``site``, ``classes``, ``params``, ``num_samples``).

- :func:`surgical_aggregate`: one round's updates -> the global parameters and class order.
- :func:`aggregate`: the same for a head mode (:mod:`cxrfl.surgical.head_modes`).
- :class:`cxrfl.surgical.round_aggregator.RoundAggregator` (its own module): what a server does
  with one round's results as they arrive (validate, add to the running mean, stitch the head).

Aggregation runs on one torch thread (:func:`cxrfl.nn.threads.single_threaded`), as
NVFlare's numpy FedAvg does: oversubscribed threads made them 17x slower on a busy machine.

Numerics of the default (mean) path: one pass over the sites, adding each site's tensors times
its weight into one running sum per key (float32, float64 for float64 inputs; small arrays are
added as one flat array per dtype), then dividing by the total weight, as NVFlare's FedAvg
does; the extra memory is about one model; non-finite inputs are detected on those sums
(NaN/Inf propagate) and only then traced back to the site. Integer buffers (BatchNorm's
``num_batches_tracked``) get the weighted mean rounded to the nearest integer, in their dtype.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cxrfl.errors import UpdateRejected
from cxrfl.nn.threads import single_threaded
from cxrfl.surgical.head_modes import BATCHNORM_MODES, PLACEHOLDER_CLASS, check_modes, drop_head, with_placeholder_head
from cxrfl.surgical.running_sum import RunningSum
from cxrfl.surgical.validation import (
    HEAD_PREFIX,
    Array,
    ParsedUpdate,
    all_finite,
    as_numpy,
    as_tensor,
    expected_dtypes,
    first_nonfinite,
    parse_update,
    shape_of,
    unique_names,
)

log = logging.getLogger(__name__)

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


def _lower_median(values: Sequence[float]) -> float:
    return float(np.quantile(values, 0.5, method="lower"))


def check_options(weighting: str, batchnorm: str, robust: str | None, clip_norm: float | None) -> None:
    """Raise ValueError for aggregation options that do not fit together.

    Args:
        weighting: one of :data:`WEIGHTINGS`.
        batchnorm: one of :data:`cxrfl.surgical.head_modes.BATCHNORM_MODES`.
        robust: one of :data:`ROBUST_MODES`.
        clip_norm: a positive bound, or None (:data:`ADAPTIVE`), with ``robust`` ``clip`` or ``median`` (see
            :data:`MEDIAN_MIN_SITES`); None without ``robust``.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {list(WEIGHTINGS)}, got {weighting!r}")
    if batchnorm not in BATCHNORM_MODES:
        raise ValueError(f"batchnorm must be one of {list(BATCHNORM_MODES)}, got {batchnorm!r}")
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


def _site_weights(parsed: Sequence[ParsedUpdate], weighting: str) -> list[float]:
    return [float(p.num_samples) if weighting == "samples" else 1.0 for p in parsed]


def _update_norm(p: ParsedUpdate, keys: Sequence[str], ref: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of the site's non-head update (params - reference) over its float keys."""
    sq = 0.0
    for k in keys:
        t = as_tensor(p.params[k])
        if t.is_floating_point():
            part = float(torch.linalg.vector_norm(t - ref[k], dtype=torch.float64)) ** 2
            if not math.isfinite(part):
                raise UpdateRejected(f"site {p.site}: non-finite values (NaN or Inf) in {k!r}")
            sq += part
    return math.sqrt(sq)


def _scale(norm: float, bound: float) -> float:
    """Factor that brings an update of ``norm`` to norm <= ``bound``."""
    return min(1.0, bound / norm) if norm > 0 else 1.0


def _raise_for_bad_key(key: str, parsed: Sequence[ParsedUpdate]) -> None:
    """Name the site behind a non-finite aggregate of ``key``."""
    bad = [p.site for p in parsed if key in p.params and not all_finite(as_tensor(p.params[key]))]
    if not bad:
        raise ValueError(f"the mean of {key!r} is not finite: values at the limit of the float range")
    also = f" (also sites {bad[1:]})" if len(bad) > 1 else ""
    raise UpdateRejected(f"site {bad[0]}: non-finite values (NaN or Inf) in {key!r}{also}")


def _mean_body(
    parsed: Sequence[ParsedUpdate],
    keys: Sequence[str],
    weights: Sequence[float],
    ref: Mapping[str, torch.Tensor] | None,
    clip_norm: float | None,
    running: RunningSum | None = None,
) -> dict[str, torch.Tensor]:
    """(Weighted) mean of the non-head keys, streaming; with ``ref``, of deltas clipped to ``clip_norm``
    (None: :data:`ADAPTIVE`).

    ``running``: these updates' sum, already accumulated (with these weights, no clipping).
    """
    total = sum(weights)
    clipping = ref is not None
    if running is None:
        running = RunningSum(keys)
        norms = [_update_norm(p, keys, ref) for p in parsed] if clipping else []
        bound = clip_norm if clip_norm is not None else _lower_median(norms) if norms else 0.0
        for i, (w, p) in enumerate(zip(weights, parsed)):
            scale = _scale(norms[i], bound) if clipping else 1.0
            running.add(p.site, p.params, w * scale, int_weight=w)
    out = running.sums()
    running.usable = False  # its sums become the mean, in place
    floats = [k for k in keys if running.dtype(k).is_floating_point]
    for k in keys:
        out[k].div_(total)
    if clipping:
        kept = 1.0 - sum(w for _, w in running.added) / total
        for k in floats:
            out[k].add_(ref[k], alpha=kept)  # = ref + sum_i c_i (x_i - ref), c_i = w_i scale_i / total
    bad = first_nonfinite((k, out[k]) for k in floats)
    if bad is not None:
        _raise_for_bad_key(bad, parsed)
    return {
        k: (out[k] if running.dtype(k).is_floating_point else torch.round(out[k])).to(running.dtype(k)) for k in keys
    }


def _median_body(parsed: Sequence[ParsedUpdate], keys: Sequence[str]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for k in keys:
        stack = np.stack([as_numpy(p.params[k]) for p in parsed])
        med = np.median(stack, axis=0)
        dtype = stack.dtype
        out[k] = (np.rint(med) if not np.issubdtype(dtype, np.floating) else med).astype(dtype)
    return out


def _aggregate_head(
    parsed: Sequence[ParsedUpdate],
    global_classes: Sequence[str],
    weights: Sequence[float],
    *,
    head_prefix: str,
    robust: str | None,
    clip_norm: float | None,
    ref_rows: dict[str, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head row per global class from exactly the sites that have the class."""
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    rows: dict[str, list[tuple[float, torch.Tensor]]] = {c: [] for c in global_classes}
    for w, p in zip(weights, parsed):
        W, b = as_tensor(p.params[wkey]), as_tensor(p.params[bkey])
        for key, t in ((wkey, W), (bkey, b)):
            if not all_finite(t):
                raise UpdateRejected(f"site {p.site}: non-finite values (NaN or Inf) in {key!r}")
        site_rows = torch.cat([W, b[:, None]], dim=1).to(torch.float64)  # [K_site, N + 1]
        for j, c in enumerate(p.classes):
            rows[c].append((w, site_rows[j]))
    n_in = shape_of(parsed[0].params[wkey])[1]
    zero = torch.zeros(n_in + 1, dtype=torch.float64)  # the reference of a class new this round
    bound = clip_norm
    if robust is not None and bound is None:  # ADAPTIVE: the median norm of every row sent this round
        refs = ref_rows or {}
        bound = _lower_median(
            [float(torch.linalg.vector_norm(r - refs.get(c, zero))) for c in global_classes for _, r in rows[c]]
        )
    merged = torch.empty(len(global_classes), n_in + 1, dtype=torch.float64)
    for i, c in enumerate(global_classes):
        contrib = rows[c]
        ref = ref_rows.get(c) if ref_rows is not None else None
        total = sum(w for w, _ in contrib)
        if not contrib:
            if ref is None:
                raise ValueError(
                    f"no site sent class {c!r}; pass reference= (the previous global params) to keep "
                    "its row, or leave it out of classes="
                )
            merged[i] = ref
        elif robust == "median" and len(contrib) >= MEDIAN_MIN_SITES:
            merged[i] = torch.from_numpy(np.median(np.stack([r.numpy() for _, r in contrib]), axis=0))
        elif robust is not None and bound is not None:  # clip, or a median of 1-2 rows: clipped around
            ref = ref if ref is not None else zero  # the reference row, the zero row if new
            merged[i] = ref + sum(
                (w / total) * _scale(float(torch.linalg.vector_norm(r - ref)), bound) * (r - ref) for w, r in contrib
            )
        else:
            merged[i] = sum((w / total) * r for w, r in contrib)
    dtype = as_tensor(parsed[0].params[wkey]).dtype
    return merged[:, :n_in].to(dtype), merged[:, n_in].to(dtype)


def _reference_tensors(
    reference: Mapping[str, Array],
    shapes: Mapping[str, tuple[int, ...]],
    classes: Sequence[str] | None,
    head_prefix: str,
    for_clip: bool,
    need_head: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Reference body tensors (clipping only) and head rows per class (rows in ``classes`` order);
    ``need_head``: clipping needs the reference head (else rows are clipped around the zero row)."""
    body: dict[str, torch.Tensor] = {}
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    for k, shape in shapes.items():
        if k in (wkey, bkey) or not for_clip:
            continue
        if k not in reference or shape_of(reference[k]) != shape:
            found = shape_of(reference[k]) if k in reference else "nothing"
            raise ValueError(f"reference must hold {k!r} with shape {shape}, found {found}")
        body[k] = as_tensor(reference[k])
    has_head = wkey in reference and bkey in reference
    if for_clip and need_head and not has_head:
        raise ValueError(f"robust='clip' needs the reference head ({wkey!r}, {bkey!r})")
    if classes is None or not has_head:
        return body, None
    W, b = as_tensor(reference[wkey]), as_tensor(reference[bkey])
    want = (len(classes), shapes[wkey][1])
    if shape_of(W) != want or shape_of(b) != want[:1]:
        raise ValueError(
            f"reference head has shapes {shape_of(W)} and {shape_of(b)}; expected {want} and {want[:1]}: one row "
            "per entry of classes= (without classes=: per class of the sorted union of this round's sites)"
        )
    rows = torch.cat([W, b[:, None]], dim=1).to(torch.float64)
    return body, {c: rows[i] for i, c in enumerate(classes)}


def _parse_all(
    updates: Iterable[Mapping[str, Any]],
    *,
    head_prefix: str,
    order: list[str] | None,
    check_finite: bool,
    drop: frozenset[str],
    dtypes: Mapping[str, str],
) -> list[ParsedUpdate]:
    """Every update checked against ``dtypes`` and the first one's shapes and dtypes; one update per site."""
    updates = updates if isinstance(updates, Sequence) else list(updates)
    if not updates:
        raise ValueError("no updates to aggregate")
    parsed: list[ParsedUpdate] = []
    expected: dict[str, tuple[int, ...]] | None = None
    for update in updates:
        p = parse_update(
            update,
            expected_shapes=expected,
            head_prefix=head_prefix,
            announced_classes=order,
            check_finite=check_finite,
            drop=drop,
            dtypes=dtypes,
        )
        if p.site in {q.site for q in parsed}:
            raise UpdateRejected(f"site {p.site}: sent more than one update this round")
        parsed.append(p)
        if expected is None:
            expected = {k: shape_of(v) for k, v in p.params.items()}
            dtypes = {**expected_dtypes(p.params), **dtypes}
    return parsed


@single_threaded
def surgical_aggregate(
    updates: Iterable[Mapping[str, Any]],
    *,
    head_prefix: str = HEAD_PREFIX,
    weighting: str = "uniform",
    batchnorm: str = "fedavg",
    bn_keys: Iterable[str] = (),
    classes: Sequence[str] | None = None,
    robust: str | None = None,
    clip_norm: float | None = None,
    reference: Mapping[str, Array] | None = None,
    running: RunningSum | None = None,
) -> tuple[dict[str, Array], list[str]]:
    """Aggregate site updates whose heads cover different classes.

    Non-head keys: FedAvg (uniform mean, or weighted by ``num_samples``). Head row of class c:
    the (weighted) mean of the rows for c of exactly the sites that have c, so a class of one
    site keeps that site's row; with identical class sets everywhere this is FedAvg.

    Args:
        updates: site updates (see the module docstring); a one-shot iterator is read into a list.
        head_prefix: state-dict prefix of the head (``<prefix>weight`` [K, N], ``<prefix>bias`` [K]).
        weighting: ``uniform`` (the papers) or ``samples`` (weights = num_samples).
        batchnorm: ``fedavg`` (bn_keys averaged like the rest), ``fedbn`` (bn_keys left out of
            the result: sites keep their own) or ``fedbn+`` (left out too: sites keep them
            frozen at pretrained statistics). In both fedbn modes sites may omit bn_keys.
        bn_keys: state-dict names of BatchNorm entries (:func:`cxrfl.nn.models.batchnorm_keys`).
        classes: global class order; every site class must be in it. Default: sorted union.
        robust: None (mean), ``median`` (coordinate-wise, unweighted; head rows over the sites
            having the class; a group of fewer than :data:`MEDIAN_MIN_SITES` contributors, whose
            median would be their mean, is clipped as with ``clip``) or ``clip`` (each site's
            ``params - reference`` clipped to L2 norm ``clip_norm`` before averaging: one norm over
            all float non-head keys, one per head row incl. its bias; the mean delta is added back
            to the reference; a class without a reference row, as in a warm-up or a late join, is
            clipped around the zero row, i.e. its row's norm is at most ``clip_norm``).
        clip_norm: the clipping norm (``clip`` and ``median``); None: :data:`ADAPTIVE`, the lower median norm
            of this round's updates (one bound for the feature extractor, one for the head rows).
        reference: the previous global params, head rows in ``classes`` order (without
            ``classes``: in the order of the returned sorted union; the head may be absent then).
            Needed by robust='clip' (and by a median of fewer than 3 updates); with ``classes``, a
            class no site sent this round keeps its reference row. Every update must have the
            dtype of its key here (else of the first update).
        running: the non-head sum of exactly these updates, fed as they arrived (what
            :class:`RoundAggregator` does at accept time, so each update
            is read once); used only for the plain mean (``robust=None``) and when its sites,
            weights and keys match, else the mean is computed from the updates. With it the
            updates may carry their head only (their feature extractors summed and dropped).

    Returns:
        (global params of the input kind, CPU for torch; global class names in head row order).

    Raises:
        UpdateRejected: an update fails :func:`validate_update` (incl. a class outside
            ``classes``), or two updates name the same site.
        ValueError: bad options, no updates, or a class of ``classes`` nobody sent and no reference.
    """
    check_options(weighting, batchnorm, robust, clip_norm)
    if robust == "clip" and reference is None:
        raise ValueError("robust='clip' needs reference= (the previous global params)")
    ref_dtypes = expected_dtypes(reference) if reference is not None else {}
    bn_keys = list(bn_keys)
    head_bn = [k for k in bn_keys if k.startswith(head_prefix)]
    if head_bn:
        raise ValueError(f"bn_keys may not include head parameters: {head_bn}")
    drop = frozenset(bn_keys) if batchnorm != "fedavg" else frozenset()
    order = unique_names(classes, "classes") if classes is not None else None
    parsed = _parse_all(
        updates, head_prefix=head_prefix, order=order, check_finite=robust == "median", drop=drop, dtypes=ref_dtypes
    )
    few = robust == "median" and len(parsed) < MEDIAN_MIN_SITES  # the feature extractor is clipped instead
    if few and reference is None:
        raise ValueError(f"robust='median' over fewer than {MEDIAN_MIN_SITES} updates clips them: pass reference=")
    expected = {k: shape_of(v) for k, v in parsed[0].params.items()}
    global_classes = order if order is not None else sorted(set().union(*(p.classes for p in parsed)))
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    keys = [k for k in parsed[0].params if not k.startswith(head_prefix)]
    weights = _site_weights(parsed, weighting)
    summed = (
        running is not None
        and running.usable
        and robust is None
        and running.added == list(zip((p.site for p in parsed), weights))
    )
    if not keys and running is not None and running.keys:  # feature extractors summed as they arrived, dropped
        if not summed:
            raise ValueError(
                "the updates' feature extractors were dropped, but the running sum is not theirs "
                "(other sites, weights or a robust mode)"
            )
        keys = list(running.keys)
    ref_body, ref_rows = (
        ({}, None)
        if reference is None
        else _reference_tensors(
            reference,
            expected,
            global_classes if order is not None or robust is not None else None,
            head_prefix,
            for_clip=robust == "clip" or few,
            need_head=order is not None,
        )
    )

    body: Mapping[str, Array]
    if robust == "median" and not few:
        body = _median_body(parsed, keys)
    else:
        fits = summed and running.keys == keys
        body = _mean_body(parsed, keys, weights, ref_body or None, clip_norm, running if fits else None)
    head_w, head_b = _aggregate_head(
        parsed, global_classes, weights, head_prefix=head_prefix, robust=robust, clip_norm=clip_norm, ref_rows=ref_rows
    )
    numpy_out = isinstance(parsed[0].params[wkey], np.ndarray)
    result: dict[str, Array] = {}
    for k in [*(k for k in keys if k not in parsed[0].params), *parsed[0].params]:
        value = head_w if k == wkey else head_b if k == bkey else body[k]
        result[k] = as_numpy(value) if numpy_out else value if isinstance(value, torch.Tensor) else as_tensor(value)
    return result, list(global_classes)


def aggregate(
    updates: Sequence[Mapping[str, Any]],
    *,
    head_mode: str,
    head_prefix: str = HEAD_PREFIX,
    **kwargs: Any,
) -> tuple[dict[str, Any], list[str]]:
    """Combine one round's site updates for a head mode.

    ``surgical`` and ``union`` are :func:`surgical_aggregate` (with every site holding every
    class, a union head is plain FedAvg); ``local`` averages the feature extractor only (updates
    carry no head) and returns no classes.

    Args:
        updates: update mappings (see :mod:`cxrfl.surgical.validation`); ``local`` updates have
            no head entries.
        head_mode: ``surgical``, ``union`` or ``local``.
        head_prefix: state-dict prefix of the head.
        kwargs: further :func:`surgical_aggregate` arguments (weighting, batchnorm, bn_keys,
            classes, reference, robust, clip_norm); ``local`` ignores classes and reference rows.

    Returns:
        (aggregated params, global classes in head row order; [] for ``local``).
    """
    check_modes(head_mode, "negative")
    if head_mode != "local":
        if head_mode == "union":
            sets = {tuple(sorted(u["classes"])) for u in updates}
            if len(sets) > 1:
                raise ValueError("union heads: every site must send the same classes")
        return surgical_aggregate(updates, head_prefix=head_prefix, **kwargs)
    kwargs.pop("classes", None)
    reference = kwargs.pop("reference", None)
    if reference is not None:
        kwargs["reference"] = with_placeholder_head(drop_head(reference, head_prefix), head_prefix)
    wrapped = [
        {
            **u,
            "classes": [PLACEHOLDER_CLASS],
            "params": with_placeholder_head(drop_head(u["params"], head_prefix), head_prefix),
        }
        for u in updates
    ]
    params, _ = surgical_aggregate(wrapped, head_prefix=head_prefix, **kwargs)
    return drop_head(params, head_prefix), []
