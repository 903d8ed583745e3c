"""SimSiam's random views: one MONAI chain per image (CPU sites) and the same draws on whole batches (GPU sites).

A view is a random crop of 50-100 % of each side resized back, a horizontal flip, a rotation (+-10 degrees, zeros
outside), gamma contrast, intensity scale and shift (grey-level "colour jitter"), Gaussian blur and noise, then the
normalisation of :func:`cxrfl.data.transforms.build_transforms`. The ranges and probabilities are declared once
here (:class:`ViewRanges`, :data:`VIEW`) and used by both:

* :func:`view_transforms`: MONAI transforms per image, in a :class:`TwoViewDataset` (what a CPU site runs);
* :class:`BatchViews`: the same draws per image on the device a batch is on. Crop, resize and flip become one
  affine resampling and rotation a second (``affine_grid``/``grid_sample``, bilinear, as MONAI resamples
  twice), blur a separable convolution with each image's own sigmas. On a GPU site the per-image chain (about
  4 ms per view on one CPU thread) kept the GPU waiting: on an H100 with four seeds side by side a stage-1
  round took 33 s, all of it in this chain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
    Randomizable,
    RandRotate,
    RandScaleCrop,
    RandScaleIntensity,
    RandShiftIntensity,
    RepeatChannel,
    Resize,
)
from torch.utils.data import Dataset

from cxrfl.data.transforms import BatchTransform, LoadGrayscale, mean_std


@dataclass(frozen=True)
class ViewRanges:
    """The ranges and probabilities of a SimSiam view.

    Args:
        crop_scale: each side keeps between this share and all of the image.
        flip_prob: horizontal flip.
        rotate_degrees: rotation up to this many degrees either way (zeros outside).
        rotate_prob: rotation.
        gamma: gamma contrast range.
        contrast_prob: contrast.
        scale: intensity times 1 + U(-scale, scale).
        scale_prob: intensity scale.
        shift: intensity plus U(-shift, shift).
        shift_prob: intensity shift.
        sigma: Gaussian blur sigma range, per axis.
        blur_prob: blur.
        noise_std: Gaussian noise whose standard deviation is drawn from U(0, noise_std).
        noise_prob: noise.
    """

    crop_scale: float = 0.5
    flip_prob: float = 0.5
    rotate_degrees: float = 10.0
    rotate_prob: float = 0.5
    gamma: tuple[float, float] = (0.6, 1.6)
    contrast_prob: float = 0.8
    scale: float = 0.2
    scale_prob: float = 0.8
    shift: float = 0.1
    shift_prob: float = 0.8
    sigma: tuple[float, float] = (0.1, 1.0)
    blur_prob: float = 0.5
    noise_std: float = 0.03
    noise_prob: float = 0.2


VIEW = ViewRanges()
"""The views of both implementations."""
BLUR_TRUNCATE = 4.0
"""The blur kernel reaches this many sigmas (MONAI's ``GaussianFilter`` default)."""


def view_transforms(image_size: int, in_channels: int = 3) -> tuple[Compose, Compose]:
    """The deterministic loader and the per-image random view transform of SimSiam.

    Returns:
        ``(load, view)``: ``load`` maps a path to a resized [1, S, S] float array in [0, 1]
        (cacheable); ``view`` maps that to one random normalised view [C, S, S] (:data:`VIEW`).

    Args:
        image_size: output side in pixels.
        in_channels: 3 (grey replicated, ImageNet mean/std) or 1.
    """
    mean, std = mean_std(in_channels)
    load = Compose(
        [LoadGrayscale(), EnsureChannelFirst(channel_dim="no_channel"), Resize((image_size, image_size), mode="area")]
    )
    v = VIEW
    steps = [
        RandScaleCrop(roi_scale=v.crop_scale, max_roi_scale=1.0, random_center=True, random_size=True),
        Resize((image_size, image_size), mode="bilinear"),
        RandFlip(prob=v.flip_prob, spatial_axis=1),
        RandRotate(range_x=math.radians(v.rotate_degrees), prob=v.rotate_prob, padding_mode="zeros"),
        RandAdjustContrast(prob=v.contrast_prob, gamma=v.gamma),
        RandScaleIntensity(factors=v.scale, prob=v.scale_prob),
        RandShiftIntensity(offsets=v.shift, prob=v.shift_prob),
        RandGaussianSmooth(sigma_x=v.sigma, sigma_y=v.sigma, prob=v.blur_prob),
        RandGaussianNoise(prob=v.noise_prob, std=v.noise_std),
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
        batch_views: return each loaded image once ([1, S, S]) for :class:`BatchViews` to draw the views on the
            device, instead of two views.
    """

    def __init__(
        self,
        paths: Sequence[str],
        image_size: int,
        in_channels: int = 3,
        seed: int = 0,
        images: Sequence[np.ndarray] | None = None,
        batch_views: bool = False,
    ) -> None:
        _, self.view = view_transforms(image_size, in_channels)
        self.images = list(images) if images is not None else self.load_images(paths, image_size)
        if len(self.images) != len(paths):
            raise ValueError(f"{len(self.images)} loaded images for {len(paths)} paths")
        self.view.set_random_state(seed=int(seed) % (2**32))
        self.batch_views = batch_views

    @staticmethod
    def load_images(paths: Sequence[str], image_size: int) -> list[np.ndarray]:
        """Read and resize the images once ([1, S, S] arrays in [0, 1])."""
        load, _ = view_transforms(image_size, 1)
        return [np.asarray(load(str(p))) for p in paths]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        image = self.images[index]
        if self.batch_views:
            return (torch.as_tensor(image, dtype=torch.float32),)
        return self.view(image), self.view(image)


def gaussian_kernels(sigma: torch.Tensor) -> torch.Tensor:
    """MONAI's ``gaussian_1d`` (``erf``, truncated at :data:`BLUR_TRUNCATE` sigmas, not normalised) for each sigma,
    zero-padded to the length of the longest ([N, K], K odd).

    Args:
        sigma: [N] standard deviations in pixels (> 0).
    """
    tails = (torch.clamp(sigma.float() * BLUR_TRUNCATE, min=0.5) + 0.5).floor()
    tail = int(tails.max())
    t = torch.arange(-tail, tail + 1, device=sigma.device, dtype=torch.float32)[None, :]
    s = 0.70710678 / sigma.float().abs()[:, None]
    k = (0.5 * (torch.erf(s * (t + 0.5)) - torch.erf(s * (t - 0.5)))).clamp(min=0)
    return torch.where(t.abs() <= tails[:, None], k, torch.zeros_like(k))


def blur(x: torch.Tensor, sigma_x: torch.Tensor, sigma_y: torch.Tensor) -> torch.Tensor:
    """Each image of a batch blurred with its own sigmas, as MONAI's ``GaussianSmooth`` (separable, zeros outside).

    Args:
        x: [B, 1, H, W] images.
        sigma_x: [B] sigma along the first spatial axis (rows, MONAI's ``sigma_x``).
        sigma_y: [B] sigma along the second (columns).
    """
    b = x.shape[0]
    kx, ky = gaussian_kernels(sigma_x).to(x.dtype), gaussian_kernels(sigma_y).to(x.dtype)
    y = x.reshape(1, b, *x.shape[2:])
    y = F.conv2d(y, kx[:, None, :, None], padding=(kx.shape[1] // 2, 0), groups=b)
    y = F.conv2d(y, ky[:, None, None, :], padding=(0, ky.shape[1] // 2), groups=b)
    return y.reshape_as(x)


class BatchViews(Randomizable):
    """SimSiam views of a whole batch, drawn per image on the batch's device (:data:`VIEW`).

    Seeded like a MONAI transform (``set_random_state``): each call draws a new generator seed from it, and the
    parameters are drawn on the device from that generator.

    Args:
        in_channels: 3 (grey replicated, ImageNet mean/std) or 1.
    """

    def __init__(self, in_channels: int = 3) -> None:
        self.normalise = BatchTransform(in_channels, augment=False)  # channels and mean/std, as every GPU batch

    def draw(self, n: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Draw the parameters of ``n`` views on ``device``.

        Returns:
            ``scale`` [n, 2] (kept fraction of rows, columns), ``centre`` [n, 2] (normalised), ``flip`` [n]
            (-1/1), ``angle`` [n] (radians), ``gamma``, ``factor`` (intensity times), ``offset`` (plus),
            ``sigma`` [n, 2] (0: no blur), ``noise`` [n] (standard deviation).
        """
        v = VIEW
        g = torch.Generator(device=device).manual_seed(int(self.R.randint(2**31 - 1)))
        u = torch.rand(18, n, generator=g, device=device)
        probs = (v.flip_prob, v.rotate_prob, v.contrast_prob, v.scale_prob, v.shift_prob, v.blur_prob, v.noise_prob)
        on = [u[i] < p for i, p in enumerate(probs)]
        scale = v.crop_scale + u[7:9].T * (1 - v.crop_scale)
        zero, one = torch.zeros(n, device=device), torch.ones(n, device=device)
        return {
            "scale": scale,
            "centre": (2 * u[9:11].T - 1) * (1 - scale),
            "flip": torch.where(on[0], -one, one),
            "angle": torch.where(on[1], (2 * u[11] - 1) * math.radians(v.rotate_degrees), zero),
            "gamma": torch.where(on[2], v.gamma[0] + u[12] * (v.gamma[1] - v.gamma[0]), one),
            "factor": torch.where(on[3], 1 + (2 * u[13] - 1) * v.scale, one),
            "offset": torch.where(on[4], (2 * u[14] - 1) * v.shift, zero),
            "sigma": torch.where(on[5][:, None], v.sigma[0] + u[15:17].T * (v.sigma[1] - v.sigma[0]), zero[:, None]),
            "noise": torch.where(on[6], u[17] * v.noise_std, zero),
        }

    @staticmethod
    def geometry(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        """Crop, resize and flip as one resampling (the image's border repeated, as ``Resize`` does), then rotate
        as a second one (zeros outside), as MONAI's chain resamples twice: output point ``q`` (normalised) of the
        first samples the input at ``centre + scale * flip(q)``; the second samples that at ``rotation^-1 q``."""
        n, zero = len(x), torch.zeros(len(x), device=x.device, dtype=x.dtype)
        sx, sy = p["scale"][:, 1], p["scale"][:, 0]  # affine_grid's x is the column axis
        crop = torch.stack(
            [
                torch.stack([sx * p["flip"], zero, p["centre"][:, 1]], -1),
                torch.stack([zero, sy, p["centre"][:, 0]], -1),
            ],
            1,
        ).to(x.dtype)
        y = F.grid_sample(
            x, F.affine_grid(crop, list(x.shape), align_corners=False), padding_mode="border", align_corners=False
        )
        cos, sin = torch.cos(p["angle"]).to(x.dtype), torch.sin(p["angle"]).to(x.dtype)
        turn = torch.stack([torch.stack([cos, sin, zero], -1), torch.stack([-sin, cos, zero], -1)], 1)
        turned = F.grid_sample(
            y, F.affine_grid(turn, list(y.shape), align_corners=False), padding_mode="zeros", align_corners=False
        )
        return torch.where((p["angle"] != 0).view(n, 1, 1, 1), turned, y)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """A batch of loaded images [B, 1, S, S] in [0, 1] -> one normalised view of each [B, C, S, S]."""
        if x.ndim != 4 or x.shape[1] != 1:
            raise ValueError(f"expected a batch of one-channel images [B, 1, H, W], got {tuple(x.shape)}")
        p = self.draw(len(x), x.device)
        y = BatchTransform.contrast(self.geometry(x, p), p["gamma"])
        y = y * p["factor"].view(-1, 1, 1, 1) + p["offset"].view(-1, 1, 1, 1)
        sigma = p["sigma"]
        if bool((sigma > 0).any()):
            blurred = blur(y, sigma[:, 0].clamp_min(1e-3), sigma[:, 1].clamp_min(1e-3))
            y = torch.where((sigma[:, 0] > 0).view(-1, 1, 1, 1), blurred, y)
        g = torch.Generator(device=y.device).manual_seed(int(self.R.randint(2**31 - 1)))
        noise = torch.randn(y.shape, generator=g, device=y.device, dtype=y.dtype)
        y = y + noise * p["noise"].view(-1, 1, 1, 1).to(y.dtype)
        return self.normalise(y)
