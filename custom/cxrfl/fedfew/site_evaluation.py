"""A FedFew site's metrics of a stage-2 model on one split: the BCE over the CCs and "no CC" (stage
2's validation loss), the AUROC of the CCs the site labels with their binned counts when the
server asks, and the training prevalence its UCs' detection metrics are also reported at.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from cxrfl.clinical.counts import count_classes
from cxrfl.fedfew.energy import no_cc_targets
from cxrfl.nn.losses import masked_bce
from cxrfl.nn.metrics import per_class_auroc, summarise_auroc


def cc_loss(logits: torch.Tensor, table: pd.DataFrame, cc_classes: list[str]) -> dict[str, float | int | None]:
    """Masked BCE of the CC and "no CC" outputs over the known labels of ``table``.

    Args:
        logits: [n, K+1] float logits of the table's rows.
        table: rows with the CC columns (NaN: unknown).
        cc_classes: the CCs, in output order.
    """
    y = torch.tensor(table[cc_classes].to_numpy(dtype=np.float32))
    target, mask = no_cc_targets(torch.nan_to_num(y), (~torch.isnan(y)).float())
    known = int(mask.sum())
    loss = float(masked_bce(logits, target, mask)) if known else None
    return {"cc_loss": loss, "cc_known": known}


def cc_metrics(
    logits: torch.Tensor,
    table: pd.DataFrame,
    cc_classes: list[str],
    own_cc: list[str],
    counts: Mapping[str, Any] | None = None,
    groups: Mapping[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """``cc_loss`` and ``cc_known`` (:func:`cc_loss`), the AUROC of the site's own CCs
    (``cc_auroc``, ``cc_mean_auroc``) and, when asked, their binned counts (``counts``).

    Args:
        logits: [n, K+1] float logits of the table's rows.
        table: the role table of the split.
        cc_classes: every CC, in output order.
        own_cc: the CCs the site labels.
        counts: a server's request for binned counts (:func:`cxrfl.clinical.counts.count_request`).
        groups: the rows' subgroup memberships (:func:`cxrfl.clinical.subgroups.memberships`), with ``counts``.
    """
    result: dict[str, Any] = cc_loss(logits.cpu(), table, cc_classes)
    scores = torch.sigmoid(logits).cpu().numpy()[:, : len(cc_classes)]
    cols = [cc_classes.index(c) for c in own_cc]
    y = table[own_cc].to_numpy(dtype=np.float64)
    aurocs = per_class_auroc(y, scores[:, cols], own_cc)
    result["cc_auroc"] = aurocs
    result["cc_mean_auroc"] = summarise_auroc(aurocs)["mean"]
    if counts is not None:
        result["counts"] = count_classes(scores[:, cols], y, own_cc, counts, groups=groups)
    return result


def train_prevalence(train: pd.DataFrame, ucs: Sequence[str]) -> dict[str, float | None]:
    """Share of positives among the known labels of each UC in the site's training split (None: no
    known label, or only one kind).

    Args:
        train: the role table of the training split.
        ucs: the UCs.
    """
    out: dict[str, float | None] = {}
    for uc in ucs:
        y = train[uc].dropna().to_numpy(dtype=np.float64)
        share = float(y.mean()) if len(y) else None
        out[uc] = share if share is not None and 0 < share < 1 else None
    return out
