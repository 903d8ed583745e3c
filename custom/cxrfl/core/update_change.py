"""How a site's result differs from the model it was sent: the norm of the change, its unchanged share.

Part of the shared federated core (framework-free). One primitive, :func:`change_sq`, the squared L2
norm of a change in float64, serves both the record a server keeps of every accepted result
(:func:`compare_to_sent`, per site and round in ``rounds.jsonl``: ``update_norm``, ``unchanged_share``)
and the bound clipped updates are held to (:func:`cxrfl.core.fedavg.weighted_mean`). A result whose
norm is far above the round's median gets one warning line naming its site (:func:`outlying_norms`):
a scaled update is named even where no robust option is on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

OUTLIER_FACTOR = 10.0
"""An update whose norm passes this multiple of the round's median update norm gets a warning line."""


def _float64(x: Any) -> torch.Tensor:
    """A float64 tensor of an array or tensor (an array is copied: received arrays are often read-only,
    which torch warns about; bfloat16 tensors, which numpy lacks, stay in torch)."""
    return x.to(torch.float64) if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x, dtype=np.float64))


def change_sq(value: Any, reference: Any) -> float:
    """Squared L2 norm of ``value - reference``, the difference taken in float64 (exact for float32 inputs).

    Args:
        value: an array or CPU tensor.
        reference: an array or CPU tensor of the same shape.
    """
    return float(torch.linalg.vector_norm(_float64(value) - _float64(reference))) ** 2


def compare_to_sent(params: Mapping[str, Any], reference: Mapping[str, Any]) -> tuple[float, float] | None:
    """How a result differs from the model it was sent, over the floating-point parameters both hold
    with the same shape: the share of values left equal, and the L2 norm of the change.

    Args:
        params: a site's validated result.
        reference: the parameters it was sent.

    Returns:
        (unchanged share, update norm), or None when nothing can be compared.
    """
    same = total = 0
    squares = 0.0
    for k, v in params.items():
        ref = reference.get(k)
        a = np.asarray(v)
        if ref is None or not np.issubdtype(a.dtype, np.floating):
            continue
        r = np.asarray(ref)
        if r.shape != a.shape:
            continue
        same += int(np.count_nonzero(a == r))
        total += a.size
        squares += change_sq(a, r)
    return (same / total, float(np.sqrt(squares))) if total else None


def change_fields(changes: Mapping[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """The round record's fields of the accepted results' changes: ``unchanged_share`` and ``update_norm``,
    each site -> value (rounded to 6 decimals), sites sorted.

    Args:
        changes: site -> (unchanged share, update norm) (:func:`compare_to_sent`).
    """
    ordered = sorted(changes.items())
    return {
        "unchanged_share": {s: round(share, 6) for s, (share, _) in ordered},
        "update_norm": {s: round(norm, 6) for s, (_, norm) in ordered},
    }


ROBUST_ADVICE = "check that site (robust: median or clip bounds it)"
"""What an operator of an aggregating server can do about an outlying update."""


def outlying_norms(norms: Mapping[str, float], advice: str = ROBUST_ADVICE) -> list[str]:
    """One warning line per site whose update norm passes :data:`OUTLIER_FACTOR` times the round's median
    (with 3 or more sites: a scaled update is named even where nothing else stops it).

    Args:
        norms: site -> update norm (the second of :func:`compare_to_sent`'s pair).
        advice: the line's last words: what the operator can do.
    """
    if len(norms) < 3:
        return []
    median = float(np.median(list(norms.values())))
    return [
        f"site {site}: its update norm {norm:.4g} is {norm / median:.0f}x the round's median ({median:.4g}); "
        f"a scaled or broken update: {advice}"
        for site, norm in sorted(norms.items())
        if median > 0 and norm > OUTLIER_FACTOR * median
    ]
