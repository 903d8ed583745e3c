"""Stage 1: SimSiam (Chen & He 2021) on the DenseNet feature extractor of :class:`cxrfl.nn.models.CXRNet`.

Two randomly augmented views of an image go through the encoder ``f`` (the pooled DenseNet
features), a projector ``g`` (three linear layers with BatchNorm) and a predictor ``h`` (a
bottleneck MLP). The loss is the symmetrised negative cosine similarity between the prediction
of one view and the projection of the other, with a stop-gradient on the projection:
``L = D(p1, sg(z2)) / 2 + D(p2, sg(z1)) / 2`` with ``D(p, z) = -cos(p, z)``.

The module's state-dict keys for the encoder are the network's own (``backbone.*``), so the
pretrained encoder loads straight into a :class:`CXRNet`. The views are MONAI random transforms
(crop and resize, flip, rotation, contrast, intensity, blur, noise) after the same load and
normalisation as :func:`cxrfl.data.transforms.build_transforms`. A site's local round is
:func:`simsiam_epochs` (Adam, fixed learning rate, as the paper).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from monai.transforms import (
    Compose,
    EnsureChannelFirst,
    EnsureType,
    NormalizeIntensity,
    RandAdjustContrast,
    RandFlip,
    RandGaussianNoise,
    RandGaussianSmooth,
    RandRotate,
    RandScaleCrop,
    RandScaleIntensity,
    RandShiftIntensity,
    RepeatChannel,
    Resize,
)
from torch import nn
from torch.utils.data import Dataset

from cxrfl.data.transforms import GRAY_MEAN, GRAY_STD, IMAGENET_MEAN, IMAGENET_STD, LoadGrayscale
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.nn.models import CXRNet, ModelConfig
from cxrfl.nn.precision import Compute, backward_step

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


def view_transforms(image_size: int, in_channels: int = 3) -> tuple[Compose, Compose]:
    """The deterministic loader and the random view transform of SimSiam.

    Returns:
        ``(load, view)``: ``load`` maps a path to a resized [1, S, S] float array in [0, 1]
        (cacheable); ``view`` maps that to one random normalised view [C, S, S]: a random crop
        of 50-100% of each side resized back, horizontal flip, rotation (+-10 degrees), gamma
        contrast, intensity scale and shift (grey-level "colour jitter"), Gaussian blur and noise.

    Args:
        image_size: output side in pixels.
        in_channels: 3 (grey replicated, ImageNet mean/std) or 1.
    """
    if in_channels not in (1, 3):
        raise ValueError(f"in_channels must be 1 or 3, got {in_channels}")
    load = Compose(
        [LoadGrayscale(), EnsureChannelFirst(channel_dim="no_channel"), Resize((image_size, image_size), mode="area")]
    )
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if in_channels == 3 else (GRAY_MEAN, GRAY_STD)
    steps = [
        RandScaleCrop(roi_scale=0.5, max_roi_scale=1.0, random_center=True, random_size=True),
        Resize((image_size, image_size), mode="bilinear"),
        RandFlip(prob=0.5, spatial_axis=1),
        RandRotate(range_x=math.radians(10), prob=0.5, padding_mode="zeros"),
        RandAdjustContrast(prob=0.8, gamma=(0.6, 1.6)),
        RandScaleIntensity(factors=0.2, prob=0.8),
        RandShiftIntensity(offsets=0.1, prob=0.8),
        RandGaussianSmooth(sigma_x=(0.1, 1.0), sigma_y=(0.1, 1.0), prob=0.5),
        RandGaussianNoise(prob=0.2, std=0.03),
    ]
    if in_channels > 1:
        steps.append(RepeatChannel(repeats=in_channels))
    steps += [
        NormalizeIntensity(subtrahend=mean, divisor=std, channel_wise=True),
        EnsureType(data_type="tensor", dtype=torch.float32, track_meta=False),
    ]
    return load, Compose(steps)


class TwoViewDataset(Dataset):
    """Two random views of each image (labels are not read: labelled or not, every image counts).

    The loaded, resized images are kept in memory (they are small at training sizes); the
    random views are drawn anew at every access, from a generator seeded by ``seed``.

    Args:
        paths: image files.
        image_size: output side in pixels.
        in_channels: 3 or 1.
        seed: seed of the random views.
        images: the loaded images of ``paths`` (from :meth:`load_images`), to skip reading them.
    """

    def __init__(
        self,
        paths: Sequence[str],
        image_size: int,
        in_channels: int = 3,
        seed: int = 0,
        images: Sequence[np.ndarray] | None = None,
    ) -> None:
        _, self.view = view_transforms(image_size, in_channels)
        self.images = list(images) if images is not None else self.load_images(paths, image_size)
        if len(self.images) != len(paths):
            raise ValueError(f"{len(self.images)} loaded images for {len(paths)} paths")
        self.view.set_random_state(seed=int(seed) % (2**32))

    @staticmethod
    def load_images(paths: Sequence[str], image_size: int) -> list[np.ndarray]:
        """Read and resize the images once ([1, S, S] arrays in [0, 1])."""
        load, _ = view_transforms(image_size, 1)
        return [np.asarray(load(str(p))) for p in paths]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        return self.view(image), self.view(image)


def simsiam_epochs(
    model: nn.Module,
    dataset: TwoViewDataset,
    *,
    config: FedFewConfig,
    compute: Compute,
    num_workers: int,
    round_num: int,
    site: str,
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
    opt = torch.optim.Adam(model.parameters(), lr=config.ssl_lr)
    scaler = compute.scaler()
    model.train()
    total, steps = 0.0, 0
    for _ in range(config.ssl_local_epochs):
        for i, (x1, x2) in enumerate(loader):
            if config.ssl_max_steps is not None and i >= config.ssl_max_steps:
                break
            if x1.shape[0] < 2:  # BatchNorm needs two samples
                continue
            x1, x2 = compute.inputs(x1), compute.inputs(x2)
            opt.zero_grad(set_to_none=True)
            with compute.autocast():
                p1, p2, z1, z2 = model(x1, x2)
            loss = simsiam_loss(p1.float(), p2.float(), z1.float(), z2.float())
            if not torch.isfinite(loss):
                raise FloatingPointError(f"site {site}: SimSiam loss became {loss.item()} at step {steps}")
            backward_step(loss, opt, scaler)
            total += float(loss.detach())
            steps += 1
    return (total / steps if steps else None), steps
