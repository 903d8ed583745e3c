"""Surgical aggregation: FedAvg of the feature extractor, class-wise averaging of the head.

Framework-free (no NVFlare import): parameters are numpy arrays or torch tensors and come back
as the same kind (torch results are on the CPU). Updates are the mappings of
:mod:`cxrfl.core.updates` (``site``, ``classes``, ``params``, ``num_samples``).

- :func:`surgical_aggregate`: one round's updates -> the global parameters and class order: the
  feature extractor by the shared core's FedAvg (:func:`cxrfl.core.fedavg.fedavg_keys`: weighting,
  median, clipped updates), each head row from exactly the sites that have its class.
- :func:`aggregate`: the same for a head mode (:mod:`cxrfl.surgical.head_modes`); ``local`` is the
  core's FedAvg of the feature extractor alone.
- :class:`cxrfl.surgical.round_aggregator.RoundAggregator` (its own module): what a server does
  with one round's results as they arrive (validate, add to the running mean, stitch the head).

Aggregation runs on one torch thread (:func:`cxrfl.nn.threads.single_threaded`); the numerics of
the mean are the core's (:mod:`cxrfl.core.fedavg`); head rows are averaged in float64.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cxrfl.core.fedavg import (
    MEDIAN_MIN_SITES,
    clip_scale,
    fedavg,
    fedavg_keys,
    lower_median,
    reference_tensors,
    site_weights,
)
from cxrfl.core.fedavg import check_options as check_fedavg_options
from cxrfl.core.running_sum import RunningSum
from cxrfl.core.updates import (
    HEAD_PREFIX,
    Array,
    ParsedUpdate,
    all_finite,
    as_numpy,
    as_tensor,
    expected_dtypes,
    parse_round,
    shape_of,
    unique_names,
)
from cxrfl.errors import UpdateRejected
from cxrfl.nn.threads import single_threaded
from cxrfl.surgical.head_modes import BATCHNORM_MODES, check_modes, drop_head


def check_options(weighting: str, batchnorm: str, robust: str | None, clip_norm: float | None) -> None:
    """Raise ValueError for aggregation options that do not fit together.

    Args:
        weighting: one of :data:`cxrfl.core.fedavg.WEIGHTINGS`.
        batchnorm: one of :data:`cxrfl.surgical.head_modes.BATCHNORM_MODES`.
        robust: one of :data:`cxrfl.core.fedavg.ROBUST_MODES`.
        clip_norm: a positive bound or None (see :func:`cxrfl.core.fedavg.check_options`).
    """
    if batchnorm not in BATCHNORM_MODES:
        raise ValueError(f"batchnorm must be one of {list(BATCHNORM_MODES)}, got {batchnorm!r}")
    check_fedavg_options(weighting, robust, clip_norm)


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
        bound = lower_median(
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
                (w / total) * clip_scale(float(torch.linalg.vector_norm(r - ref)), bound) * (r - ref)
                for w, r in contrib
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
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    body_shapes = {k: shape for k, shape in shapes.items() if k not in (wkey, bkey)}
    body = reference_tensors(reference, body_shapes) if for_clip else {}
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


def _body_keys(
    parsed: Sequence[ParsedUpdate],
    weights: Sequence[float],
    head_prefix: str,
    robust: str | None,
    running: RunningSum | None,
) -> tuple[list[str], RunningSum | None]:
    """The feature extractor's keys, and the running sum its mean is read from (None: computed from the updates)."""
    keys = [k for k in parsed[0].params if not k.startswith(head_prefix)]
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
    return keys, running if summed and running is not None and running.keys == keys else None


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
    parsed = parse_round(
        updates, head_prefix=head_prefix, announced=order, check_finite=robust == "median", drop=drop, dtypes=ref_dtypes
    )
    few = robust == "median" and len(parsed) < MEDIAN_MIN_SITES  # the feature extractor is clipped instead
    if few and reference is None:
        raise ValueError(f"robust='median' over fewer than {MEDIAN_MIN_SITES} updates clips them: pass reference=")
    expected = {k: shape_of(v) for k, v in parsed[0].params.items()}
    global_classes = order if order is not None else sorted(set().union(*(p.classes for p in parsed)))
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    weights = site_weights(parsed, weighting)
    keys, running = _body_keys(parsed, weights, head_prefix, robust, running)
    clipped = robust == "clip" or few
    ref_body, ref_rows = (
        ({}, None)
        if reference is None
        else _reference_tensors(
            reference,
            expected,
            global_classes if order is not None or robust is not None else None,
            head_prefix,
            for_clip=clipped,
            need_head=order is not None,
        )
    )
    body = fedavg_keys(
        parsed,
        keys,
        weights,
        robust=robust,
        clip_norm=clip_norm,
        reference=ref_body if clipped else None,
        running=running,
    )
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
        updates: update mappings (see :mod:`cxrfl.core.updates`); the head entries of ``local``
            updates are ignored.
        head_mode: ``surgical``, ``union`` or ``local``.
        head_prefix: state-dict prefix of the head.
        kwargs: further :func:`surgical_aggregate` arguments (weighting, batchnorm, bn_keys,
            classes, reference, robust, clip_norm; ``running`` for ``surgical`` and ``union`` only);
            ``local`` ignores classes and reference rows.

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
    return _local_aggregate(updates, head_prefix, **kwargs), []


def _local_aggregate(
    updates: Sequence[Mapping[str, Any]],
    head_prefix: str,
    *,
    weighting: str = "uniform",
    batchnorm: str = "fedavg",
    bn_keys: Iterable[str] = (),
    classes: Sequence[str] | None = None,
    robust: str | None = None,
    clip_norm: float | None = None,
    reference: Mapping[str, Array] | None = None,
) -> dict[str, np.ndarray]:
    """``local`` heads: the core's FedAvg of the feature extractor alone (head entries and ``classes`` ignored)."""
    check_options(weighting, batchnorm, robust, clip_norm)
    return fedavg(
        [{**u, "params": drop_head(u["params"], head_prefix)} for u in updates],
        weighting=weighting,
        robust=robust,
        clip_norm=clip_norm,
        reference=drop_head(reference, head_prefix) if reference is not None else None,
        drop=bn_keys if batchnorm != "fedavg" else (),
    )
