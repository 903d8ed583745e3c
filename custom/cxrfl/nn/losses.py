"""Binary cross-entropy over the known labels only (partial labels across and within sites)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum", "none")


def masked_bce(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    *,
    pos_weight: torch.Tensor | None = None,
    class_weight: torch.Tensor | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """BCE with logits where ``mask`` is 1; unknown entries contribute nothing (not even NaN).

    Args:
        logits: [B, K] raw scores.
        targets: [B, K] labels in {0, 1}; values at unknown entries are ignored (NaN allowed).
        mask: [B, K], 1 (or True) where the label is known.
        pos_weight: [K] weight of the positive term per class (as in ``F.binary_cross_entropy_with_logits``).
        class_weight: [K] weight of each class's loss (e.g. a cyclically weighted loss).
        reduction: ``mean`` (sum of the weighted losses / number of known entries; 0 with a
            gradient path when no entry is known), ``sum``, or ``none`` ([B, K], 0 where unknown).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")
    if targets.shape != logits.shape or mask.shape != logits.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)}, targets {tuple(targets.shape)} and mask {tuple(mask.shape)} "
            "must have the same shape"
        )
    known = mask != 0
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    safe_targets = torch.where(known, targets.to(logits.dtype), zero)
    loss = F.binary_cross_entropy_with_logits(logits, safe_targets, reduction="none", pos_weight=pos_weight)
    if class_weight is not None:
        loss = loss * class_weight
    loss = torch.where(known, loss, zero)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / known.sum().clamp(min=1)
