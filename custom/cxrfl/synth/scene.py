"""The layered scene every frontal image is rendered from.

:func:`build_scene` turns a patient's :class:`~cxrfl.synth.anatomy.Anatomy` into layers of
attenuation on a pixel grid: soft tissue (body, shoulders, mediastinum, heart, abdomen), lung
air (two lung fields with hemidiaphragm domes and sharp costophrenic angles), bone (posterior
and anterior ribs, clavicles, spine, humeral heads, scapulae on AP views), pulmonary vessels
branching from the hila and fading to the periphery, and the bronchial tree (only visible as
air bronchograms inside consolidation). Findings then edit these layers
(:mod:`cxrfl.synth.findings`).

Side convention: ``s = -1`` is image left (the patient's right lung), ``s = +1`` image right
(the patient's left lung, next to the heart).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cxrfl.synth.anatomy import SIDES, Anatomy, Geometry, rib_curve, rib_origin, side_index
from cxrfl.synth.draw import (
    Array,
    Grid,
    blur,
    disc,
    segment_distance,
    segment_samples,
    smooth_noise,
    soft,
    splat,
)

AIR_K = 0.5
"""Attenuation removed by a full-depth column of lung air."""


@dataclass
class Scene:
    """Layers of attenuation for one frontal image; findings edit them in place.

    Args:
        grid: the pixel grid.
        geo: the analytic outlines.
        view: ``PA`` or ``AP``.
        supine: patient lying (fluid layers posteriorly, no meniscus).
        x: patient x per pixel.
        y: patient y per pixel.
        lung: soft lung masks (image-left, image-right).
        depth: lung air thickness per pixel (0 outside the lungs).
        fill: fraction of lung air displaced by fluid or tissue (0..1).
        air_gain: multiplier of lung air (hyperinflation, pneumothorax).
        soft: soft-tissue attenuation.
        bone: bone attenuation.
        vessels: pulmonary vessel attenuation.
        vessel_gain: visibility of vessels (0 = no lung markings).
        bronchi: bronchial tree, 0..1 (air kept inside consolidation).
        dense: other added densities (nodules, plaques, calcification, devices).
    """

    grid: Grid
    geo: Geometry
    view: str
    supine: bool
    x: Array
    y: Array
    lung: tuple[Array, Array]
    depth: Array
    fill: Array
    air_gain: Array
    soft: Array
    bone: Array
    vessels: Array
    vessel_gain: Array
    bronchi: Array
    dense: Array

    @property
    def px(self) -> float:
        """One pixel in patient units."""
        return self.grid.px

    @property
    def edge(self) -> float:
        """Softness of sharp anatomical edges (about 0.6 px)."""
        return 0.6 * self.grid.px + 0.002

    def lungs(self) -> Array:
        """Both lungs' mask."""
        return np.maximum(self.lung[0], self.lung[1])

    def attenuation(self) -> Array:
        """Total attenuation (bright = dense) of the scene."""
        fill = np.clip(self.fill, 0.0, 1.0)
        air = AIR_K * self.depth * (1.0 - fill) * self.air_gain
        vessels = self.vessels * self.vessel_gain * (1.0 - fill)
        return np.clip(self.soft + self.bone + vessels + self.dense - air, 0.0, None)


def _body(geo: Geometry, x: Array, y: Array, edge: float) -> Array:
    """Soft tissue of neck, shoulders, chest wall and abdomen."""
    a = geo.a
    neck = 0.2 + 0.05 * a.habitus
    shoulders = a.lung_w + 0.3
    trunk = a.lung_w + 0.06 + 0.1 * a.habitus
    bw = neck + (shoulders - neck) * soft(y - (a.apex_y - 0.2), 0.04)
    bw = bw + (trunk - shoulders) * soft(y - (a.apex_y + 0.3), 0.15)
    t = np.sqrt(np.clip(1.0 - (x / bw) ** 2, 0.0, None)) * soft(bw - np.abs(x), edge * 2)
    dome_line = np.where(x < a.med_shift, geo.dome(-1, x), geo.dome(1, x))
    abdomen = soft(y - dome_line, edge) * t
    out = 0.55 * a.habitus * t + 0.3 * abdomen
    if a.breast > 0:
        for s in SIDES:
            cx = a.med_shift + s * 0.45 * a.lung_w
            cy = geo.dome_y[side_index(s)] - 0.05
            out = out + 0.12 * a.breast * disc(x, y, cx, cy, 0.32, 0.22, 0.04) * soft(cy + 0.12 - y, 0.02)
    if a.bubble > 0.25:
        cx, cy = a.med_shift + 0.4 * a.lung_w, geo.dome(1, a.med_shift + 0.4 * a.lung_w) + 0.08  # type: ignore[assignment,arg-type]  # a scalar x gives a scalar height
        r = 0.035 + 0.06 * a.bubble
        out = out - 0.3 * disc(x, y, cx, cy, r * 1.3, r, edge) * soft(y - (cy - r * 0.9), edge)
    return out


def _mediastinum(geo: Geometry, x: Array, y: Array, edge: float) -> tuple[Array, Array]:
    """Mediastinum, heart, trachea and main bronchi (air); also returns the heart mask."""
    a = geo.a
    half = np.maximum(geo.medial(-1, y), geo.medial(1, y))
    right, left = geo.medial(-1, y), geo.medial(1, y)
    d = x - a.med_shift
    band = soft(np.where(d < 0, right + d, left - d), edge * 1.5) * soft(y - (a.apex_y - 0.3), 0.1)
    heart = geo.heart_mask(x, y, edge * 1.5)
    out = 0.34 * np.maximum(band, heart) + 0.06 * heart
    carina = (a.med_shift, a.heart_top - 0.1)
    tw = 0.034
    trachea = soft(tw - np.abs(x - a.med_shift * 0.7), edge) * soft(carina[1] - y, edge)
    out = out - 0.3 * trachea * soft(half - np.abs(d), edge)
    for s, (dx, dy) in ((-1, (0.13, 0.1)), (1, (0.16, 0.12))):
        dist = segment_distance(x, y, carina, (carina[0] + s * dx, carina[1] + dy))
        out = out - 0.18 * soft(0.7 * tw - dist, edge)
    return out, heart


def _ribs(geo: Geometry, x: Array, y: Array, edge: float, px: float) -> Array:
    """Posterior and anterior ribs (with fractures), clavicles, spine, humeral heads, scapulae."""
    a = geo.a
    out = np.zeros_like(x)
    y0 = rib_origin(a)
    for s in SIDES:
        cx, cy, ax, ayt, ayb = geo.lung_ellipse(s)
        cage = soft(1.0 + 0.05 / ax - geo.lung_radius(s, x, y), 0.01) * soft(max(geo.dome_y) + 0.3 - y, 0.05)
        u = s * (x - a.med_shift) - 0.04
        side = soft(u, edge)
        t = (y - rib_curve(geo, u, y) - y0) / a.rib_dy
        for br in (b for b in a.rib_breaks if b.side == s):
            near = np.abs(t - br.rib) < 0.75
            t = np.where(near, t - br.offset * soft(u - br.u, edge), t)
        k = np.round(t)
        q = np.abs(t - k) * a.rib_dy
        half = 0.24 * a.rib_dy
        band = soft(half - q, edge) * (0.8 + 0.4 * np.exp(-(((q - half) / (1.2 * px + 0.004)) ** 2)))
        valid = (k >= 0) & (k <= 11)
        for br in (b for b in a.rib_breaks if b.side == s):
            gap = (np.abs(u - br.u) < br.gap / 2) & (np.abs(t - br.rib) < 0.6)
            band = np.where(gap, 0.0, band)
        out += 0.1 * band * valid * side * cage
        v = a.lung_w - s * (x - a.med_shift)
        ta = (y - (0.5 * v - 0.2 * v**2) - (a.apex_y + 0.02)) / (a.rib_dy * 1.05)
        qa = np.abs(ta - np.round(ta)) * a.rib_dy
        anterior = soft(0.22 * a.rib_dy - qa, edge) * soft(0.5 - v, 0.06) * soft(v + 0.02, edge)
        out += 0.07 * anterior * (np.round(ta) >= 0) * (np.round(ta) <= 6) * cage
        # clavicle: from the sternoclavicular joint up-laterally to the acromion
        cu = s * (x - a.med_shift)
        clav_y = a.apex_y + 0.07 - 0.06 * geo.ap - 0.12 * (cu - 0.06) + 0.1 * (cu - 0.06) * (cu - 0.66)
        clav = soft(0.024 - np.abs(y - clav_y), edge) * soft(cu - 0.06, 0.01) * soft(0.68 - cu, 0.02)
        out += 0.22 * clav
        head = disc(x, y, a.med_shift + s * (a.lung_w + 0.24), a.apex_y - 0.02, 0.13, 0.12, edge)
        out += 0.25 * head
        if geo.ap:
            line_x = a.med_shift + s * (a.lung_w * 0.86 - 0.14 * (y - a.apex_y))
            scap = soft(s * (x - line_x), 0.01) * soft(a.apex_y + 0.5 - y, 0.04) * soft(y - a.apex_y + 0.05, 0.03)
            out += 0.05 * scap * cage
    spine = soft(0.055 - np.abs(x - a.med_shift * 0.5), edge)
    period = 0.085 * (a.rib_dy / 0.11)
    disc_space = np.exp(-(((np.mod(y - y0, period) - period / 2) / 0.008) ** 2))
    out += 0.06 * spine * (1.0 - 0.5 * disc_space) * soft(y - a.apex_y, 0.1)
    return out


def vessel_segments(geo: Geometry, seed: int) -> tuple[Array, Array, Array, Array]:
    """The pulmonary vessel trees of both lungs as straight segments.

    Args:
        geo: the outlines (hila, lung size).
        seed: the patient's tree seed (the same tree on every image of a patient).

    Returns:
        starts (m, 2), ends (m, 2), widths (m,), generation (m,).
    """
    rng = np.random.default_rng(seed)
    p0s, p1s, ws, levels = [], [], [], []
    scale = geo.height / 0.98
    for s in SIDES:
        hx, hy = geo.hilum(s)
        angles = np.deg2rad(np.array([-80.0, -45.0, -12.0, 22.0, 55.0, 85.0]) + rng.normal(0, 6, 6))
        pos = np.stack(
            [hx + s * rng.uniform(-0.02, 0.03, 6), hy + np.array([-0.07, -0.04, -0.01, 0.02, 0.05, 0.07]) * scale], 1
        )
        length = rng.uniform(0.13, 0.19, 6) * scale
        width = np.full(6, 0.024)
        for level in range(7):
            end = pos + np.stack([s * np.cos(angles), np.sin(angles)], 1) * length[:, None]
            p0s.append(pos)
            p1s.append(end)
            ws.append(width)
            levels.append(np.full(len(pos), level))
            n = len(pos)
            spread = np.deg2rad(rng.uniform(12, 38, (n, 2))) * np.array([-1.0, 1.0])
            angles = (angles[:, None] + spread + np.deg2rad(rng.normal(0, 7, (n, 2)))).reshape(-1)
            pos = np.repeat(end, 2, axis=0)
            length = np.repeat(length, 2) * rng.uniform(0.6, 0.84, 2 * n)
            width = np.repeat(width, 2) * 0.7
    return np.concatenate(p0s), np.concatenate(p1s), np.concatenate(ws), np.concatenate(levels)


def _trees(geo: Geometry, grid: Grid, seed: int) -> tuple[Array, Array]:
    """Vessel and bronchus layers drawn from the vessel tree, clipped to the lungs."""
    p0, p1, width, level = vessel_segments(geo, seed)
    pts, ds, idx = segment_samples(p0, p1, grid.px * 0.5)
    x, y = pts[:, 0], pts[:, 1]
    inside = np.maximum(geo.lung(-1, x, y, 0.01), geo.lung(1, x, y, 0.01))
    hx = np.where(x < geo.a.med_shift, geo.hilum(-1)[0], geo.hilum(1)[0])
    hy = np.where(x < geo.a.med_shift, geo.hilum(-1)[1], geo.hilum(1)[1])
    reach = np.hypot(x - hx, (y - hy) * 0.8) / (0.7 * geo.a.lung_w)
    fade = np.clip(1.0 - 0.75 * reach, 0.1, 1.0) * (1.0 - geo.a.vessel_prune * np.clip(reach * 1.6 - 0.4, 0, 1))
    w = width[idx]
    area = grid.px**2
    h, wd = grid.height, grid.width
    big, small, bronchi = np.zeros((h, wd)), np.zeros((h, wd)), np.zeros((h, wd))
    mass = 0.38 * w * ds * inside * fade / area
    coarse = level[idx] <= 1
    splat(big, grid, x[coarse], y[coarse], mass[coarse])
    splat(small, grid, x[~coarse], y[~coarse], mass[~coarse])
    keep = (level[idx] >= 1) & (level[idx] <= 4)
    side = np.where(x < geo.a.med_shift, -1.0, 1.0)
    splat(bronchi, grid, x[keep] + side[keep] * 0.01, y[keep] + 0.006, (0.55 * w * ds * inside / area)[keep])
    vessels = blur(big, max(0.5, 0.01 / grid.px)) + blur(small, 0.5)
    return vessels, np.clip(blur(bronchi, 0.5), 0.0, 1.0)


def build_scene(anat: Anatomy, height: int, width: int, view: str = "PA", supine: bool = False) -> Scene:
    """Render the normal anatomy of a frontal chest image into layers.

    Args:
        anat: the patient (with finding-driven geometry already applied).
        height: image rows.
        width: image columns.
        view: ``PA`` or ``AP``.
        supine: lying patient (AP only).
    """
    grid = Grid(height, width, anat.scale, anat.shift, anat.rotation)
    x, y = grid.coords()
    geo = Geometry(anat, view)
    edge = 0.6 * grid.px + 0.002
    lungs = (geo.lung(-1, x, y, edge), geo.lung(1, x, y, edge))
    mediastinum, heart = _mediastinum(geo, x, y, edge)
    depth = np.zeros_like(x)
    for s, mask in zip(SIDES, lungs):
        r = geo.lung_radius(s, x, y)
        depth += mask * (0.45 + 0.55 * np.sqrt(np.clip(1.0 - r**2, 0.0, None)))
    depth *= 1.0 - 0.8 * heart
    vessels, bronchi = _trees(geo, grid, anat.tree_seed)
    if supine:
        vessels *= 1.0 + 0.25 * soft(geo.hilum(-1)[1] - y, 0.1)
    zeros = np.zeros_like(x)
    texture = 0.04 * (1.0 + smooth_noise(np.random.default_rng(anat.tree_seed + 1), x.shape, 26 * width / 128))
    return Scene(
        grid=grid,
        geo=geo,
        view=view,
        supine=supine,
        x=x,
        y=y,
        lung=lungs,
        depth=depth,
        fill=np.clip(texture, 0.0, 0.2),
        air_gain=np.full_like(x, anat.air),
        soft=_body(geo, x, y, edge) + mediastinum,
        bone=_ribs(geo, x, y, edge, grid.px),
        vessels=vessels,
        vessel_gain=np.ones_like(x),
        bronchi=bronchi,
        dense=zeros.copy(),
    )
