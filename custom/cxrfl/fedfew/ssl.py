"""Stage 1: SimSiam (Chen & He 2021) on the DenseNet feature extractor of :class:`cxrfl.nn.models.CXRNet`.

Two randomly augmented views of an image go through the encoder ``f`` (the pooled DenseNet
features), a projector ``g`` (three linear layers with BatchNorm) and a predictor ``h`` (a
bottleneck MLP). The loss is the symmetrised negative cosine similarity between the prediction
of one view and the projection of the other, with a stop-gradient on the projection:
``L = D(p1, sg(z2)) / 2 + D(p2, sg(z1)) / 2`` with ``D(p, z) = -cos(p, z)``.

The module's state-dict keys for the encoder are the network's own (``backbone.*``), so the
pretrained encoder loads straight into a :class:`CXRNet`. The views (crop and resize, flip, rotation,
contrast, intensity, blur, noise) are :mod:`cxrfl.fedfew.ssl_views`. A site's local round is
:func:`simsiam_epochs` (Adam, fixed learning rate, as the paper).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.ssl_views import BatchViews, TwoViewDataset
from cxrfl.nn.models import CXRNet, ModelConfig
from cxrfl.nn.precision import Compute
from cxrfl.nn.training import train_steps

ENCODER_PREFIX = "backbone."
"""State-dict prefix of the encoder (the DenseNet feature extractor) in both SimSiam and CXRNet."""


def load_encoder(net: CXRNet, ssl_state: Mapping[str, Any]) -> None:
    """Load the encoder of SimSiam weights into a network's feature extractor.

    Args:
        net: the network.
        ssl_state: SimSiam weights (arrays or tensors).
    """
    net.backbone.load_state_dict(
        {
            k[len(ENCODER_PREFIX) :]: torch.as_tensor(np.asarray(v))
            for k, v in ssl_state.items()
            if k.startswith(ENCODER_PREFIX)
        }
    )


class SimSiam(nn.Module):
    """Encoder (a CXRNet's feature extractor), projector and predictor.

    Args:
        net: the network whose ``backbone`` (and ``features``) is the encoder; only the
            backbone is kept (the head is not part of self-supervised learning).
        proj_dim: projector output size.
        pred_dim: predictor bottleneck size.
    """

    def __init__(self, net: CXRNet, proj_dim: int = 2048, pred_dim: int = 512) -> None:
        super().__init__()
        self.backbone = net.backbone
        dim = net.backbone.norm5.num_features
        self.projector = nn.Sequential(
            nn.Linear(dim, proj_dim, bias=False),
            nn.BatchNorm1d(proj_dim),
            nn.ReLU(inplace=True),
            nn.Linear(proj_dim, proj_dim, bias=False),
            nn.BatchNorm1d(proj_dim),
            nn.ReLU(inplace=True),
            nn.Linear(proj_dim, proj_dim, bias=False),
            nn.BatchNorm1d(proj_dim, affine=False),
        )
        self.predictor = nn.Sequential(
            nn.Linear(proj_dim, pred_dim, bias=False),
            nn.BatchNorm1d(pred_dim),
            nn.ReLU(inplace=True),
            nn.Linear(pred_dim, proj_dim),
        )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled encoder features [B, D] (as :meth:`CXRNet.features`)."""
        return torch.flatten(F.adaptive_avg_pool2d(F.relu(self.backbone(x)), 1), 1)

    def forward(
        self, x1: torch.Tensor, x2: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Predictions and projections of both views: ``(p1, p2, z1, z2)``.

        Args:
            x1: first views [B, C, H, W].
            x2: second views of the same images.
        """
        z1 = self.projector(self.encode(x1))
        z2 = self.projector(self.encode(x2))
        return self.predictor(z1), self.predictor(z2), z1, z2


def ssl_model(model_config: ModelConfig, config: FedFewConfig) -> SimSiam:
    """The SimSiam network of stage 1 (its encoder is a CXRNet feature extractor)."""
    return SimSiam(CXRNet(model_config, 1), config.ssl_proj_dim, config.ssl_pred_dim)


def negative_cosine(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """SimSiam's ``D(p, z) = -cos(p, sg(z))``, averaged over the batch (gradient to ``p`` only)."""
    return -F.cosine_similarity(p, z.detach(), dim=-1).mean()


def simsiam_loss(p1: torch.Tensor, p2: torch.Tensor, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """Symmetrised SimSiam loss ``D(p1, z2) / 2 + D(p2, z1) / 2`` (in [-1, 1]; -1 is perfect agreement)."""
    return 0.5 * negative_cosine(p1, z2) + 0.5 * negative_cosine(p2, z1)


def simsiam_epochs(
    model: nn.Module,
    dataset: TwoViewDataset,
    *,
    config: FedFewConfig,
    compute: Compute,
    num_workers: int,
    round_num: int,
    site: str,
    views: BatchViews | None = None,
) -> tuple[float | None, int]:
    """A round's local SimSiam training (``ssl_local_epochs``, at most ``ssl_max_steps`` steps each).

    Args:
        model: the SimSiam network, prepared for ``compute`` and loaded with the received weights.
        dataset: the site's two-view images.
        config: FedFew settings (``ssl_*``, ``seed``).
        compute: device and precision.
        num_workers: data-loader workers.
        round_num: the round (seeds the shuffling).
        site: the site's name, for the message of a non-finite loss.
        views: draw the two views of each batch on ``compute``'s device (the dataset returns images,
            ``batch_views``); None: the dataset draws them per image.

    Returns:
        The mean SimSiam loss (None: no step) and the number of optimiser steps.
    """
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=config.ssl_batch_size,
        shuffle=True,
        drop_last=len(dataset) > config.ssl_batch_size,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(config.seed + round_num),
    )
    model.train()

    def simsiam(batch: Any) -> torch.Tensor | None:
        if batch[0].shape[0] < 2:  # BatchNorm needs two samples
            return None
        if views is not None:
            x = batch[0].to(compute.device, non_blocking=True)
            batch = [views(x), views(x)]
        x1, x2 = compute.inputs(batch[0]), compute.inputs(batch[1])
        with compute.autocast():
            p1, p2, z1, z2 = model(x1, x2)
        return simsiam_loss(p1.float(), p2.float(), z1.float(), z2.float())

    stats = train_steps(
        loader,
        torch.optim.Adam(model.parameters(), lr=config.ssl_lr),
        compute,
        simsiam,
        epochs=config.ssl_local_epochs,
        max_steps=config.ssl_max_steps,
        what=f"site {site}: SimSiam loss",
    )
    return (stats.loss if stats.steps else None), stats.steps
