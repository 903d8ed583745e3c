"""Image transforms (MONAI): load grayscale, resize, augment for training, ImageNet-normalise.

As in the surgical-aggregation papers: images scaled to [0, 1] (the intensity policy of
:mod:`cxrfl.data.images`), resized, random rotation,
flip, zoom and contrast during training, then scaled to ImageNet statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from monai.transforms import (
    Compose,
    EnsureChannelFirst,
    EnsureType,
    NormalizeIntensity,
    RandAdjustContrast,
    RandFlip,
    RandRotate,
    RandZoom,
    RepeatChannel,
    Resize,
    Transform,
)

from cxrfl.data.images import read_image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
GRAY_MEAN = (0.449,)  # the mean of the three ImageNet channel means, for one-channel models
GRAY_STD = (0.226,)


class LoadGrayscale(Transform):
    """MONAI transform: an image path -> 2-D float32 array in [0, 1] (see :func:`read_image`)."""

    def __call__(self, path: str | Path | np.ndarray) -> np.ndarray:
        """Read the image.

        Args:
            path: a PNG, JPEG or DICOM file, or an image :func:`read_image` already returned
                (passed on as is: a caller that reads first can report unreadable files itself).
        """
        return path if isinstance(path, np.ndarray) else read_image(path)


def build_transforms(image_size: int, *, train: bool, in_channels: int = 3) -> Callable[[str], torch.Tensor]:
    """The transform from an image path to a model input.

    Deterministic steps come first (load, channel, resize) so that a MONAI ``CacheDataset``
    can cache them; training adds random rotation (+-10 degrees), horizontal flip, zoom
    (0.9-1.1) and contrast (gamma 0.7-1.5), each with probability 0.5.

    Args:
        image_size: output height and width in pixels.
        train: add the random augmentations.
        in_channels: 3 (grayscale replicated, ImageNet mean/std per channel) or 1.

    Returns:
        a MONAI ``Compose``: path -> float32 tensor ``[in_channels, image_size, image_size]``.
    """
    if in_channels not in (1, 3):
        raise ValueError(f"in_channels must be 1 or 3, got {in_channels}")
    if image_size < 8:
        raise ValueError(f"image_size must be at least 8 pixels, got {image_size}")
    steps: list[Callable] = [
        LoadGrayscale(),
        EnsureChannelFirst(channel_dim="no_channel"),
        Resize((image_size, image_size), mode="area"),  # exact pixel averaging when downsampling
    ]
    if train:
        steps += [
            RandRotate(range_x=math.radians(10), prob=0.5, padding_mode="zeros"),
            RandFlip(prob=0.5, spatial_axis=1),
            RandZoom(prob=0.5, min_zoom=0.9, max_zoom=1.1, mode="bilinear", padding_mode="constant"),
            RandAdjustContrast(prob=0.5, gamma=(0.7, 1.5)),
        ]
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if in_channels == 3 else (GRAY_MEAN, GRAY_STD)
    if in_channels > 1:
        steps.append(RepeatChannel(repeats=in_channels))
    steps += [
        NormalizeIntensity(subtrahend=mean, divisor=std, channel_wise=True),
        EnsureType(data_type="tensor", dtype=torch.float32, track_meta=False),
    ]
    return Compose(steps)
