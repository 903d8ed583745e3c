"""Test sets held in memory and the per-class scoring of models on them.

A model that does not predict a class of a test set gets no score for it: the class is "not
defined" for that model (never 0.5), and so is any mean over a set of classes that contains it
(:func:`cxrfl.nn.metrics.summarise_auroc` with ``model_classes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cxrfl.data.dataset import make_loader
from cxrfl.data.site import SiteData
from cxrfl.nn.precision import Compute, as_compute


@dataclass
class TestSet:
    """Images and labels of one test set, loaded once for every model and seed.

    Args:
        name: the site (its test split) or the external test set.
        kind: ``site`` or ``external``.
        classes: the classes scored on it (its labels that some training site has).
        images: [n, C, H, W] model inputs.
        labels: [n, K] 1/0, NaN where unknown.
    """

    name: str
    kind: str
    classes: list[str]
    images: torch.Tensor
    labels: np.ndarray

    @property
    def n(self) -> int:
        return int(self.labels.shape[0])

    def positives(self) -> dict[str, int]:
        """Positive images per class."""
        return {c: int(np.nansum(self.labels[:, j])) for j, c in enumerate(self.classes)}


def load_test_set(
    data: SiteData,
    *,
    kind: str,
    classes: Sequence[str],
    image_size: int,
    in_channels: int = 3,
) -> TestSet:
    """Read a site's test split (``site``) or all its images (``external``).

    Args:
        data: the site.
        kind: ``site`` (its ``test`` split) or ``external`` (every image).
        classes: the classes to keep (those of the site that a training site has).
        image_size: model input size.
        in_channels: model input channels.
    """
    table = data.split_table("test") if kind == "site" else data.table.reset_index(drop=True)
    classes = [c for c in data.classes if c in set(classes)]
    loader = make_loader(table, classes, image_size=image_size, train=False, batch_size=64, in_channels=in_channels)
    xs, ys, ms = [], [], []
    for x, y, m in loader:
        xs.append(x)
        ys.append(y.numpy())
        ms.append(m.numpy())
    labels = np.concatenate(ys).astype(float)
    labels[np.concatenate(ms) == 0] = np.nan
    return TestSet(data.site, kind, classes, torch.cat(xs), labels)


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    images: torch.Tensor,
    batch_size: int = 64,
    compute: Compute | torch.device = torch.device("cpu"),
) -> np.ndarray:
    """Sigmoid outputs of ``model`` on ``images`` (eval mode; the training loops' inference path).

    Args:
        model: the network (moved to the device and memory format).
        images: [n, C, H, W].
        batch_size: forward batch size.
        compute: device, precision and memory format (a device: its ``auto`` settings).
    """
    compute = as_compute(compute)
    compute.prepare(model).eval()
    out = []
    for i in range(0, len(images), batch_size):
        with compute.autocast():
            logits = model(compute.inputs(images[i : i + batch_size]))
        out.append(torch.sigmoid(logits.float()).cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, 0))


def scores_on(
    model: torch.nn.Module,
    model_classes: Sequence[str],
    test: TestSet,
    compute: Compute | torch.device = torch.device("cpu"),
) -> np.ndarray:
    """[n, K_test] scores of ``model`` for the test set's classes; NaN columns for classes it lacks.

    Args:
        model: the network.
        model_classes: its output classes.
        test: the test set.
        compute: device, precision and memory format (a device: its ``auto`` settings).
    """
    probs = predict(model, test.images, compute=compute)
    index = {c: i for i, c in enumerate(model_classes)}
    out = np.full((test.n, len(test.classes)), np.nan)
    for j, c in enumerate(test.classes):
        if c in index:
            out[:, j] = probs[:, index[c]]
    return out
