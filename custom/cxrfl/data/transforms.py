"""Image transforms (MONAI): load grayscale, resize, augment for training, ImageNet-normalise.

As in the surgical-aggregation papers: images scaled to [0, 1] (the intensity policy of
:mod:`cxrfl.data.images`), resized, random rotation, flip, zoom and contrast during training,
then scaled to ImageNet statistics. The pipeline has three parts:

1. :func:`preprocess_transforms` (deterministic): path -> ``[1, size, size]`` float32 in [0, 1];
   what the site's preprocessing cache (:mod:`cxrfl.data.cache`) keeps.
2. :func:`augment_transforms` (random, training only), one image at a time.
3. :func:`input_transforms`: channels and ImageNet normalisation.

:func:`build_transforms` chains the three (path -> model input). On a GPU the loader hands
step 1's output to :class:`BatchTransform`, which does steps 2 and 3 on whole batches on the
device (same augmentation ranges, one affine resampling per batch).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path

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
    Randomizable,
    RandRotate,
    RandZoom,
    RepeatChannel,
    Resize,
    Transform,
)

from cxrfl.data import images
from cxrfl.data.images import read_image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
GRAY_MEAN = (0.449,)  # the mean of the three ImageNet channel means, for one-channel models
GRAY_STD = (0.226,)

AUGMENT_PROB = 0.5
"""Probability of each random step (rotation, flip, zoom, contrast)."""
ROTATE_DEGREES = 10.0
ZOOM_RANGE = (0.9, 1.1)
GAMMA_RANGE = (0.7, 1.5)


def _policy_digest() -> str:
    """A digest of the intensity policy's code (:mod:`cxrfl.data.images`): a change invalidates caches."""
    return hashlib.sha256(Path(images.__file__).read_bytes()).hexdigest()[:16]


class LoadGrayscale(Transform):
    """MONAI transform: an image path -> 2-D float32 array in [0, 1] (see :func:`read_image`).

    ``policy`` (a digest of the reading code) is part of the transform, so the hash MONAI's
    ``PersistentDataset`` takes of the preprocessing chain changes with the intensity policy.
    """

    def __init__(self) -> None:
        self.policy = _policy_digest()

    def __call__(self, path: str | Path | np.ndarray) -> np.ndarray:
        """Read the image.

        Args:
            path: a PNG, JPEG or DICOM file, or an image :func:`read_image` already returned
                (passed on as is: a caller that reads first can report unreadable files itself).
        """
        return path if isinstance(path, np.ndarray) else read_image(path)


def _check(image_size: int, in_channels: int) -> None:
    if in_channels not in (1, 3):
        raise ValueError(f"in_channels must be 1 or 3, got {in_channels}")
    if image_size < 8:
        raise ValueError(f"image_size must be at least 8 pixels, got {image_size}")


def preprocess_transforms(image_size: int) -> Compose:
    """The deterministic steps: path -> ``[1, image_size, image_size]`` float32 tensor in [0, 1].

    Args:
        image_size: output height and width in pixels (area interpolation: exact pixel
            averaging when downsampling).
    """
    _check(image_size, 1)
    return Compose(
        [
            LoadGrayscale(),
            EnsureChannelFirst(channel_dim="no_channel"),
            Resize((image_size, image_size), mode="area"),
            EnsureType(data_type="tensor", dtype=torch.float32, track_meta=False),
        ]
    )


def augment_transforms() -> Compose:
    """The random steps, one image at a time: rotation (+-10 degrees), horizontal flip, zoom
    (0.9-1.1) and contrast (gamma 0.7-1.5), each with probability 0.5."""
    return Compose(
        [
            RandRotate(range_x=math.radians(ROTATE_DEGREES), prob=AUGMENT_PROB, padding_mode="zeros"),
            RandFlip(prob=AUGMENT_PROB, spatial_axis=1),
            RandZoom(
                prob=AUGMENT_PROB,
                min_zoom=ZOOM_RANGE[0],
                max_zoom=ZOOM_RANGE[1],
                mode="bilinear",
                padding_mode="constant",
            ),
            RandAdjustContrast(prob=AUGMENT_PROB, gamma=GAMMA_RANGE),
        ]
    )


def mean_std(in_channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The normalisation of a model's input: ImageNet's per-channel mean and std (3 channels) or their mean (1).

    Args:
        in_channels: 3 or 1.

    Raises:
        ValueError: another number of channels.
    """
    if in_channels not in (1, 3):
        raise ValueError(f"in_channels must be 1 or 3, got {in_channels}")
    return (IMAGENET_MEAN, IMAGENET_STD) if in_channels == 3 else (GRAY_MEAN, GRAY_STD)


def input_transforms(in_channels: int = 3) -> Compose:
    """The last steps: grayscale replicated to ``in_channels``, ImageNet mean/std per channel.

    Args:
        in_channels: 3 or 1 (one channel: the mean of ImageNet's channel statistics).
    """
    _check(8, in_channels)
    mean, std = mean_std(in_channels)
    steps: list[Callable] = [RepeatChannel(repeats=in_channels)] if in_channels > 1 else []
    return Compose(
        steps
        + [
            NormalizeIntensity(subtrahend=mean, divisor=std, channel_wise=True),
            EnsureType(data_type="tensor", dtype=torch.float32, track_meta=False),
        ]
    )


def build_transforms(image_size: int, *, train: bool, in_channels: int = 3) -> Compose:
    """The transform from an image path to a model input.

    Deterministic steps come first (load, channel, resize) so that MONAI's caching datasets can
    keep them; training adds :func:`augment_transforms`.

    Args:
        image_size: output height and width in pixels.
        train: add the random augmentations.
        in_channels: 3 (grayscale replicated, ImageNet mean/std per channel) or 1.

    Returns:
        a MONAI ``Compose``: path -> float32 tensor ``[in_channels, image_size, image_size]``.
    """
    _check(image_size, in_channels)
    parts = [preprocess_transforms(image_size)] + ([augment_transforms()] if train else [])
    return Compose([*parts, input_transforms(in_channels)]).flatten()


class BatchTransform(Randomizable):
    """Steps 2 and 3 of the pipeline on a whole batch, on the device it is on (the GPU that trains).

    Augmentation draws, per image, the same steps with the same ranges and probabilities as
    :func:`augment_transforms`: rotation, flip and zoom become one affine resampling of the
    batch (``torch.nn.functional.affine_grid``/``grid_sample``, bilinear, zeros outside), then
    MONAI's contrast formula per image. The parameters are drawn on the device (no copy, no
    synchronisation) from a generator seeded by this transform's MONAI random state, so it is
    seeded like any MONAI transform (``set_random_state``).

    Args:
        in_channels: 3 or 1 (see :func:`input_transforms`).
        augment: draw random augmentations (training).
    """

    def __init__(self, in_channels: int = 3, *, augment: bool) -> None:
        _check(8, in_channels)
        self.in_channels = in_channels
        self.augment = augment
        mean, std = mean_std(in_channels)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def randomize(self, n: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Draw the parameters of ``n`` images on ``device``: angle (radians), flip (-1/1), zoom, gamma."""
        g = torch.Generator(device=device).manual_seed(int(self.R.randint(2**31 - 1)))
        u = torch.rand(7, n, generator=g, device=device)
        on = u[:4] < AUGMENT_PROB
        limit, one = math.radians(ROTATE_DEGREES), torch.ones(n, device=device)
        return {
            "angle": torch.where(on[0], (2 * u[4] - 1) * limit, 0 * one),
            "flip": torch.where(on[1], -one, one),
            "zoom": torch.where(on[2], ZOOM_RANGE[0] + u[5] * (ZOOM_RANGE[1] - ZOOM_RANGE[0]), one),
            "gamma": torch.where(on[3], GAMMA_RANGE[0] + u[6] * (GAMMA_RANGE[1] - GAMMA_RANGE[0]), one),
        }

    @staticmethod
    def geometry(x: torch.Tensor, angle: torch.Tensor, flip: torch.Tensor, zoom: torch.Tensor) -> torch.Tensor:
        """Rotate, then flip, then zoom each image about its centre (the order of the MONAI steps).

        Output pixel p samples the input at ``rotation^-1 @ flip @ p / zoom`` (normalised coordinates).
        """
        cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
        zero = torch.zeros_like(cos)
        theta = torch.stack([torch.stack([cos * flip, sin, zero], -1), torch.stack([-sin * flip, cos, zero], -1)], 1)
        grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)

    @staticmethod
    def contrast(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        """MONAI's ``AdjustContrast`` per image: ``((x - min) / (range + 1e-7)) ** gamma * range + min``."""
        g = gamma.to(x.dtype).view(-1, 1, 1, 1)
        lo = x.amin(dim=(1, 2, 3), keepdim=True)
        span = x.amax(dim=(1, 2, 3), keepdim=True) - lo
        return torch.where(g == 1.0, x, ((x - lo) / (span + 1e-7)) ** g * span + lo)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """A batch of :func:`preprocess_transforms` outputs ``[B, 1, H, W]`` -> model inputs ``[B, C, H, W]``."""
        if x.ndim != 4 or x.shape[1] != 1:
            raise ValueError(f"expected a batch of one-channel images [B, 1, H, W], got {tuple(x.shape)}")
        if self.augment and len(x):
            p = self.randomize(len(x), x.device)
            x = self.contrast(self.geometry(x, p["angle"], p["flip"], p["zoom"]), p["gamma"])
        if self.mean.device != x.device:  # moved once
            self.mean, self.std = self.mean.to(x.device), self.std.to(x.device)
        return (x.expand(-1, self.in_channels, -1, -1) - self.mean) / self.std
