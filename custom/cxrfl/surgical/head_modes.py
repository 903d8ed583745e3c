"""The head modes of surgical aggregation and the papers' baselines: their names, and what each
site receives.

Owns every mode constant (:data:`HEAD_MODES`, :data:`MISSING_POLICIES`, :data:`BATCHNORM_MODES`);
framework-free. The server (:mod:`cxrfl.surgical.server`) sends :func:`payload_for` and combines
the answers with :mod:`cxrfl.surgical.aggregation`; the site side is
:class:`cxrfl.surgical.learner.SiteLearner` with the same ``head_mode``:

- ``surgical``: a site receives the feature extractor and the rows of its own classes; head
  rows are averaged per class over the sites that have the class.
- ``union`` (vanilla FL, FL with partial loss): a site receives the whole union head and the
  class list; every site sends every row, so the head is plain FedAvg. Every site learns every
  class name (no longer private).
- ``local`` (personalized FL): a site receives the feature extractor only and sends it only;
  heads never leave the sites. The server averages the feature extractor alone (the shared core's
  head-agnostic FedAvg, :mod:`cxrfl.core.fedavg`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cxrfl.core.updates import Array, shape_of, unique_names
from cxrfl.nn.models import HEAD_PREFIX

HEAD_MODES = ("surgical", "union", "local")
"""``surgical``: own head rows travel; ``union``: the full union head travels; ``local``: no head travels."""

MISSING_POLICIES = ("negative", "ignore")
"""What a ``union`` head does with classes the site does not annotate: label them 0, or mask them out."""

SELECTION_RULES = ("annotated", "head")
"""What a site's validation (and test) loss counts, which selects the global model: ``annotated``
(the classes the site labels only, whatever the head; every method is selected by the same rule)
or ``head`` (every head class, those a ``union`` head fills per ``missing`` included: with
``missing="negative"`` another site's classes count as negatives here, which favours early rounds;
the rule before issue 41)."""

BATCHNORM_MODES = ("fedavg", "fedbn", "fedbn+")
"""``fedavg``: BatchNorm averaged like the rest; ``fedbn``: kept at each site; ``fedbn+``: frozen at
the initial (pretrained) statistics everywhere."""


def check_modes(head_mode: str, missing: str, batchnorm: str = "fedavg", selection: str = "annotated") -> None:
    """Raise ValueError for an unknown head mode, missing-label policy, BatchNorm strategy or selection rule.

    Args:
        head_mode: one of :data:`HEAD_MODES`.
        missing: one of :data:`MISSING_POLICIES`.
        batchnorm: one of :data:`BATCHNORM_MODES`.
        selection: one of :data:`SELECTION_RULES`.
    """
    for name, value, allowed in (
        ("head_mode", head_mode, HEAD_MODES),
        ("missing", missing, MISSING_POLICIES),
        ("batchnorm", batchnorm, BATCHNORM_MODES),
        ("selection", selection, SELECTION_RULES),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def drop_head(params: Mapping[str, Any], head_prefix: str = HEAD_PREFIX) -> dict[str, Any]:
    """``params`` without the head entries (same value objects).

    Args:
        params: name -> array.
        head_prefix: state-dict prefix of the head.
    """
    return {k: v for k, v in params.items() if not k.startswith(head_prefix)}


def site_payload(
    global_params: Mapping[str, Array],
    global_classes: Sequence[str],
    site_classes: Sequence[str],
    *,
    head_prefix: str = HEAD_PREFIX,
) -> dict[str, Array]:
    """What one site receives: every non-head parameter and the head rows of its own classes.

    Non-head values are the same objects as in ``global_params`` (not copies).

    Args:
        global_params: the aggregated parameters.
        global_classes: class names in the global head's row order.
        site_classes: the site's classes, in the row order the site's head uses.
        head_prefix: state-dict prefix of the head.

    Raises:
        ValueError: a site class the global model does not have, duplicates, or a head whose
            rows do not match ``global_classes``.
    """
    site_classes = unique_names(site_classes, "site_classes")
    if not site_classes:
        raise ValueError("site_classes is empty")
    index = {c: i for i, c in enumerate(global_classes)}
    unknown = [c for c in site_classes if c not in index]
    if unknown:
        raise ValueError(f"class(es) {unknown} are not in the global model's classes {list(global_classes)}")
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    odd = [k for k in global_params if k.startswith(head_prefix) and k not in (wkey, bkey)]
    if odd or wkey not in global_params or bkey not in global_params:
        raise ValueError(f"global params must hold exactly {wkey!r} and {bkey!r} under {head_prefix!r}")
    if shape_of(global_params[wkey])[0] != len(index) or shape_of(global_params[bkey]) != (len(index),):
        raise ValueError(
            f"the global head has {shape_of(global_params[wkey])[0]} rows but {len(index)} global classes are named"
        )
    rows = [index[c] for c in site_classes]
    return {k: v[rows] if k in (wkey, bkey) else v for k, v in global_params.items()}


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
