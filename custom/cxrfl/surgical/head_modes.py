"""Server side of the head modes: what each site receives and how updates are combined.

Framework-free, shared by the NVFlare controller (:mod:`cxrfl.fl.controller`) and the
in-process benchmark (:mod:`cxrfl.bench.federated`), so both run the same arithmetic. The site
side is :class:`cxrfl.surgical.learner.SiteLearner` with the same ``head_mode``:

- ``surgical``: a site receives the feature extractor and the rows of its own classes; head
  rows are averaged per class over the sites that have the class
  (:func:`cxrfl.surgical.aggregation.surgical_aggregate`).
- ``union`` (vanilla FL, FL with partial loss): a site receives the whole union head and the
  class list; every site sends every row, so the head is plain FedAvg. Every site learns every
  class name (no longer private).
- ``local`` (personalized FL): a site receives the feature extractor only and sends it only;
  heads never leave the sites. The server averages the feature extractor alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from cxrfl.surgical.aggregation import HEAD_PREFIX, site_payload, surgical_aggregate
from cxrfl.surgical.learner import HEAD_MODES, MISSING_POLICIES

PLACEHOLDER_CLASS = "__no_head__"
"""Class name of the one-row stand-in head that lets :func:`surgical_aggregate` average a
feature extractor alone (``local`` mode); it never leaves the server."""

__all__ = [
    "HEAD_MODES",
    "MISSING_POLICIES",
    "PLACEHOLDER_CLASS",
    "aggregate",
    "check_modes",
    "drop_head",
    "payload_for",
    "with_placeholder_head",
]


def check_modes(head_mode: str, missing: str) -> None:
    """Raise ValueError for an unknown head mode or missing-label policy.

    Args:
        head_mode: one of :data:`HEAD_MODES`.
        missing: one of :data:`MISSING_POLICIES`.
    """
    if head_mode not in HEAD_MODES:
        raise ValueError(f"head_mode must be one of {HEAD_MODES}, got {head_mode!r}")
    if missing not in MISSING_POLICIES:
        raise ValueError(f"missing must be one of {MISSING_POLICIES}, got {missing!r}")


def drop_head(params: Mapping[str, Any], head_prefix: str = HEAD_PREFIX) -> dict[str, Any]:
    """``params`` without the head entries (same value objects).

    Args:
        params: name -> array.
        head_prefix: state-dict prefix of the head.
    """
    return {k: v for k, v in params.items() if not k.startswith(head_prefix)}


def with_placeholder_head(params: Mapping[str, Any], head_prefix: str = HEAD_PREFIX) -> dict[str, Any]:
    """``params`` plus a one-row zero head (for aggregating a feature extractor alone).

    Args:
        params: name -> array without head entries.
        head_prefix: state-dict prefix of the head.
    """
    out = dict(params)
    out[head_prefix + "weight"] = np.zeros((1, 1), np.float32)
    out[head_prefix + "bias"] = np.zeros((1,), np.float32)
    return out


def payload_for(
    global_params: Mapping[str, Any],
    global_classes: Sequence[str],
    site_classes: Sequence[str],
    *,
    head_mode: str,
    exclude: Iterable[str] = (),
    head_prefix: str = HEAD_PREFIX,
) -> tuple[dict[str, Any], list[str] | None]:
    """What one site receives in a round.

    Args:
        global_params: the aggregated parameters (``local``: the feature extractor only).
        global_classes: the global head's row order (unused in ``local`` mode).
        site_classes: the site's own classes, in its head's row order.
        head_mode: ``surgical``, ``union`` or ``local``.
        exclude: keys not sent (local BatchNorm under FedBN).
        head_prefix: state-dict prefix of the head.

    Returns:
        (params, class order of the sent head): ``surgical``: own rows, None (the site knows
        its classes); ``union``: every row and ``global_classes``; ``local``: no head, None.
    """
    check_modes(head_mode, "negative")
    skip = set(exclude)
    if head_mode == "surgical":
        params, classes = site_payload(global_params, global_classes, site_classes, head_prefix=head_prefix), None
    elif head_mode == "union":
        params, classes = dict(global_params), list(global_classes)
    else:
        params, classes = drop_head(global_params, head_prefix), None
    return {k: v for k, v in params.items() if k not in skip}, classes


def aggregate(
    updates: Sequence[Mapping[str, Any]],
    *,
    head_mode: str,
    head_prefix: str = HEAD_PREFIX,
    **kwargs: Any,
) -> tuple[dict[str, Any], list[str]]:
    """Combine one round's site updates for a head mode.

    ``surgical`` and ``union`` are :func:`cxrfl.surgical.aggregation.surgical_aggregate` (with every
    site holding every class, a union head is plain FedAvg); ``local`` averages the feature
    extractor only (updates carry no head) and returns no classes.

    Args:
        updates: ``{"site", "classes", "params", "num_samples"}`` mappings (see
            :mod:`cxrfl.surgical.aggregation`); ``local`` updates have no head entries.
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
        {**u, "classes": [PLACEHOLDER_CLASS], "params": with_placeholder_head(drop_head(u["params"], head_prefix), head_prefix)}
        for u in updates
    ]
    params, _ = surgical_aggregate(wrapped, head_prefix=head_prefix, **kwargs)
    return drop_head(params, head_prefix), []
