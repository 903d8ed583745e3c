"""Evaluate a global model on a site's labelled images, class by class.

The model and the test site may know different classes: AUROC is reported for every class of
either; a class the model does not predict or the site does not label is ``None`` ("not
defined"), never 0.5.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from cxrfl.data.dataset import make_loader
from cxrfl.data.site import SiteData
from cxrfl.nn.metrics import summarise_auroc
from cxrfl.nn.precision import Compute, as_compute
from cxrfl.nn.training import evaluate


def evaluate_on_site(
    model: torch.nn.Module,
    model_classes: Sequence[str],
    data: SiteData,
    *,
    image_size: int,
    splits: Iterable[str] | None = ("test",),
    batch_size: int = 32,
    compute: Compute | torch.device | None = None,
) -> dict[str, Any]:
    """Per-class AUROC of ``model`` on a site's images.

    Args:
        model: network whose outputs are ``model_classes``.
        model_classes: the model's class order.
        data: the site (its ``classes`` are the labels it has).
        image_size: model input size.
        splits: which splits to use (None: all images, e.g. an external test site).
        batch_size: evaluation batch size.
        compute: device, precision and memory format (a device: its ``auto`` settings; default:
            the CPU's).

    Returns:
        ``images`` evaluated, ``loss``, ``auroc`` (class -> AUROC or None) and the
        :func:`cxrfl.nn.metrics.summarise_auroc` fields (``n`` = classes with a defined AUROC).
    """
    compute = as_compute(compute or torch.device("cpu"))
    table = data.table if splits is None else data.table[data.table["split"].isin(list(splits))]
    frame = pd.DataFrame({"path": table["path"].values, "patient": table["patient"].values})
    for c in model_classes:
        frame[c] = table[c].values if c in data.classes else np.nan
    loader = make_loader(frame, list(model_classes), image_size=image_size, train=False, batch_size=batch_size)
    result = evaluate(model, loader, list(model_classes), compute)
    aurocs: dict[str, float | None] = dict(result.aurocs)
    for c in data.classes:
        aurocs.setdefault(c, None)
    return {**summarise_auroc(aurocs), "images": int(len(frame)), "loss": result.loss, "auroc": aurocs}


def shared_classes(site_classes: Mapping[str, Sequence[str]]) -> list[str]:
    """Classes annotated by at least two sites.

    Args:
        site_classes: site -> its classes.
    """
    counts: dict[str, int] = {}
    for classes in site_classes.values():
        for c in set(classes):
            counts[c] = counts.get(c, 0) + 1
    return sorted(c for c, n in counts.items() if n >= 2)
