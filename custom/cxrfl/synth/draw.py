"""Vectorised drawing primitives on a patient-coordinate grid (numpy + scipy.ndimage).

Patient coordinates: x from image left (the patient's right) to image right, y from head to
feet; the thorax spans roughly ``[-0.75, 0.75] x [-0.7, 0.5]``. A :class:`Grid` maps them to
the pixels of one image, including the patient's shift, zoom and rotation in the frame.
Curves and trees are drawn by splatting their line integral into pixels and blurring by about
half a pixel, so thin structures keep their total density at every image size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

Array = np.ndarray


@dataclass(frozen=True)
class Grid:
    """Pixel grid of one image and its patient coordinates.

    Args:
        height: image rows.
        width: image columns.
        scale: patient units -> image units (image width = 2 image units).
        shift: patient origin in image units (x, y).
        rotation: in-plane rotation of the patient in radians.
    """

    height: int
    width: int
    scale: float = 1.0
    shift: tuple[float, float] = (0.0, 0.0)
    rotation: float = 0.0

    @property
    def px(self) -> float:
        """One pixel in patient units."""
        return 2.0 / self.width / self.scale

    def coords(self) -> tuple[Array, Array]:
        """Patient coordinates (x, y) of every pixel centre, each of shape (height, width)."""
        half_h = self.height / self.width
        xi = (np.arange(self.width) + 0.5) / self.width * 2.0 - 1.0
        yi = (np.arange(self.height) + 0.5) / self.height * 2.0 * half_h - half_h
        xi, yi = np.meshgrid(xi - self.shift[0], yi - self.shift[1])
        c, s = np.cos(self.rotation), np.sin(self.rotation)
        x, y = (c * xi + s * yi) / self.scale, (-s * xi + c * yi) / self.scale
        return x.astype(np.float32), y.astype(np.float32)

    def to_pixels(self, x: Array, y: Array) -> tuple[Array, Array]:
        """Fractional (row, column) pixel positions of patient points."""
        c, s = np.cos(self.rotation), np.sin(self.rotation)
        xi = (c * x - s * y) * self.scale + self.shift[0]
        yi = (s * x + c * y) * self.scale + self.shift[1]
        half_h = self.height / self.width
        col = (xi + 1.0) / 2.0 * self.width - 0.5
        row = (yi + half_h) / (2.0 * half_h) * self.height - 0.5
        return row, col


def soft(z: Array | float, width: float) -> Array:
    """Smooth step from 0 (``z <= -2 width``) to 1 (``z >= 2 width``), cubic in between."""
    t = np.asarray(z) * (0.25 / max(width, 1e-9))
    t += 0.5
    np.clip(t, 0.0, 1.0, out=t)
    return t * t * (3.0 - 2.0 * t)


def ellipse_r(x: Array, y: Array, cx: float, cy: float, ax: float, ay: float) -> Array:
    """Normalised elliptical radius (1 on the ellipse)."""
    return np.sqrt(((x - cx) / ax) ** 2 + ((y - cy) / ay) ** 2)


def disc(x: Array, y: Array, cx: float, cy: float, ax: float, ay: float, edge: float) -> Array:
    """Soft filled ellipse mask.

    Args:
        x: patient x of the pixels.
        y: patient y of the pixels.
        cx: centre x.
        cy: centre y.
        ax: semi-axis along x.
        ay: semi-axis along y.
        edge: edge softness in patient units.
    """
    r = ellipse_r(x, y, cx, cy, ax, ay)
    return soft((1.0 - r) * min(ax, ay), edge)


def dome(x: Array, y: Array, cx: float, cy: float, ax: float, ay: float) -> Array:
    """Rounded profile ``sqrt(1 - r^2)`` of an ellipsoid (0 outside), e.g. a nodule's thickness."""
    r2 = ((x - cx) / ax) ** 2 + ((y - cy) / ay) ** 2
    return np.sqrt(np.clip(1.0 - r2, 0.0, None))


def segment_distance(x: Array, y: Array, p0: tuple[float, float], p1: tuple[float, float]) -> Array:
    """Distance of every pixel to the segment p0-p1."""
    dx, dy = p1[0] - p0[0], p1[1] - p0[1]
    t = np.clip(((x - p0[0]) * dx + (y - p0[1]) * dy) / max(dx * dx + dy * dy, 1e-12), 0.0, 1.0)
    return np.hypot(x - p0[0] - t * dx, y - p0[1] - t * dy)


def bezier(points: Array, n: int) -> Array:
    """``n`` points (n, 2) on the Bezier curve with control points ``points`` (k, 2)."""
    t = np.linspace(0.0, 1.0, n)[:, None, None]
    pts = np.broadcast_to(np.asarray(points, dtype=np.float64), (n, len(points), 2))
    while pts.shape[1] > 1:
        pts = pts[:, :-1] * (1 - t) + pts[:, 1:] * t
    return pts[:, 0]


def segment_samples(p0: Array, p1: Array, step: float) -> tuple[Array, Array, Array]:
    """Points every ``step`` along many segments p0[i]-p1[i].

    Args:
        p0: (m, 2) segment starts.
        p1: (m, 2) segment ends.
        step: spacing in patient units.

    Returns:
        points (k, 2), the arc length each point stands for (k,), and its segment index (k,).
    """
    seg = np.asarray(p1, dtype=np.float64) - np.asarray(p0, dtype=np.float64)
    lengths = np.hypot(seg[:, 0], seg[:, 1])
    counts = np.maximum(np.ceil(lengths / step).astype(np.int64), 1)
    idx = np.repeat(np.arange(len(seg)), counts)
    frac = (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts) + 0.5) / counts[idx]
    return np.asarray(p0, dtype=np.float64)[idx] + seg[idx] * frac[:, None], (lengths / counts)[idx], idx


def polyline_samples(points: Array, step: float) -> tuple[Array, Array]:
    """Points every ``step`` along a polyline (k, 2) and the arc length each one stands for."""
    pts = np.asarray(points, dtype=np.float64)
    out, ds, _ = segment_samples(pts[:-1], pts[1:], step)
    return out, ds


def splat(layer: Array, grid: Grid, x: Array, y: Array, weight: Array) -> None:
    """Add point masses (patient coordinates) to ``layer`` with bilinear weights, in place.

    Args:
        layer: (height, width) float array.
        grid: the image grid.
        x: point x.
        y: point y.
        weight: mass per point, already divided by the pixel area.
    """
    row, col = grid.to_pixels(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64))
    r0, c0 = np.floor(row).astype(np.int64), np.floor(col).astype(np.int64)
    fr, fc = row - r0, col - c0
    h, w = layer.shape
    flat = layer.reshape(-1)
    weight = np.broadcast_to(np.asarray(weight, dtype=np.float64), row.shape)
    for dr, dc, wgt in ((0, 0, (1 - fr) * (1 - fc)), (0, 1, (1 - fr) * fc), (1, 0, fr * (1 - fc)), (1, 1, fr * fc)):
        rr, cc = r0 + dr, c0 + dc
        ok = (rr >= 0) & (rr < h) & (cc >= 0) & (cc < w)
        flat += np.bincount(rr[ok] * w + cc[ok], weights=(weight * wgt)[ok], minlength=h * w)


def stroke(layer: Array, grid: Grid, points: Array, width: float, density: float) -> None:
    """Draw a thin line of the given physical width and density along a polyline, in place.

    The line's density times width is conserved (thinner than a pixel = fainter); the caller
    blurs the layer.

    Args:
        layer: (height, width) float array.
        grid: the image grid.
        points: (k, 2) polyline in patient coordinates.
        width: line width in patient units.
        density: attenuation per unit thickness.
    """
    pts, ds = polyline_samples(points, grid.px * 0.4)
    splat(layer, grid, pts[:, 0], pts[:, 1], density * width * ds / grid.px**2)


def smooth_noise(rng: np.random.Generator, shape: tuple[int, int], cells: float) -> Array:
    """Zero-mean, unit-variance smooth random field with about ``cells`` blobs across the width.

    Args:
        rng: random generator.
        shape: (height, width).
        cells: number of correlation lengths across the image width.
    """
    sigma = max(shape[1] / max(cells, 1.0) / 2.0, 0.5)
    field = ndimage.gaussian_filter(rng.standard_normal(shape), sigma, mode="wrap")
    return field / max(float(field.std()), 1e-12)


def blur(layer: Array, sigma_px: float) -> Array:
    """Gaussian blur with ``sigma_px`` pixels (no-op below 0.05)."""
    return ndimage.gaussian_filter(layer, sigma_px, mode="nearest") if sigma_px >= 0.05 else layer
