"""A patient's chest anatomy and the layered scene every frontal image is rendered from.

:class:`Anatomy` holds one patient's proportions (thorax size, inspiration, heart size,
mediastinum, habitus, rib spacing, the seed of the vessel tree); follow-up images of a
patient reuse it with a new position in the frame. :func:`build_scene` turns it into layers of
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

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from cxrfl.synth.draw import (
    Array,
    Grid,
    blur,
    disc,
    ellipse_r,
    segment_distance,
    segment_samples,
    smooth_noise,
    soft,
    splat,
)

SIDES = (-1, 1)
AIR_K = 0.5
"""Attenuation removed by a full-depth column of lung air."""


def side_index(s: int) -> int:
    """0 for the image-left (patient right) side, 1 for image right."""
    return 0 if s < 0 else 1


@dataclass(frozen=True)
class RibBreak:
    """A rib fracture: the band of rib ``rib`` on side ``side`` is interrupted and offset.

    Args:
        side: -1 image left, +1 image right.
        rib: posterior rib index (0 = first visible).
        u: lateral distance of the break from the spine, patient units.
        offset: step of the lateral fragment in rib-spacing units.
        gap: width of the interruption, patient units.
    """

    side: int
    rib: int
    u: float
    offset: float
    gap: float


@dataclass(frozen=True)
class Anatomy:
    """One patient's chest proportions (patient units, see :mod:`cxrfl.synth.draw`).

    Args:
        sex: ``M`` or ``F``.
        age: years.
        scale: zoom of the patient in the frame.
        shift: position of the patient in the frame (x, y).
        rotation: in-plane rotation, radians.
        lung_w: half-width of the thoracic cavity.
        apex_y: height of the lung apices.
        dome_y: dome heights of the (right, left) hemidiaphragm (inspiration).
        dome_k: curvature of the domes (depth of the costophrenic recesses).
        med_w: half-width of the upper mediastinum.
        med_shift: mediastinal shift towards image right.
        ctr: cardiothoracic ratio on a PA view.
        heart_right: fraction of the heart width right of the midline (image left).
        heart_top: height of the upper heart border.
        habitus: soft-tissue thickness factor.
        breast: breast shadow strength (0 for men).
        bubble: gastric air bubble size.
        rib_dy: vertical spacing of the posterior ribs.
        rib_phase: vertical offset of the rib cage.
        tree_seed: seed of this patient's vessel tree.
        med_widen: extra upper mediastinal width (Enlarged Cardiomediastinum).
        air: lung air factor (> 1 hyperinflated).
        vessel_prune: fraction of peripheral vessels lost (emphysema).
        rib_breaks: fractures.
    """

    sex: str
    age: int
    scale: float
    shift: tuple[float, float]
    rotation: float
    lung_w: float
    apex_y: float
    dome_y: tuple[float, float]
    dome_k: float
    med_w: float
    med_shift: float
    ctr: float
    heart_right: float
    heart_top: float
    habitus: float
    breast: float
    bubble: float
    rib_dy: float
    rib_phase: float
    tree_seed: int
    med_widen: float = 0.0
    air: float = 1.0
    vessel_prune: float = 0.0
    rib_breaks: tuple[RibBreak, ...] = field(default=())

    def replace(self, **changes: object) -> Anatomy:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def with_dome(self, s: int, dy: float) -> Anatomy:
        """A copy with the hemidiaphragm of side ``s`` moved down by ``dy`` (negative = raised)."""
        dome = list(self.dome_y)
        dome[side_index(s)] += dy
        return self.replace(dome_y=(dome[0], dome[1]))


def sample_anatomy(rng: np.random.Generator, sex: str | None = None, age: int | None = None) -> Anatomy:
    """Draw a random adult (or, rarely, adolescent) chest.

    Args:
        rng: random generator.
        sex: ``M``/``F`` (random if None).
        age: years (random adult if None).
    """
    sex = sex or ("M" if rng.random() < 0.56 else "F")
    age = int(age if age is not None else rng.integers(20, 85))
    size = 1.0 if age >= 16 else 0.85 + 0.01 * age
    apex = -0.68 + rng.normal(0, 0.03)
    inspiration = rng.normal(0, 0.045)
    return Anatomy(
        sex=sex,
        age=age,
        scale=float(size * rng.uniform(1.05, 1.2) * (1.02 if sex == "M" else 0.98)),
        shift=(float(rng.normal(0, 0.025)), float(rng.normal(0.03, 0.025))),
        rotation=float(rng.normal(0, 0.03)),
        lung_w=float(rng.uniform(0.6, 0.7)),
        apex_y=float(apex),
        dome_y=(float(0.38 + inspiration + rng.normal(0, 0.01)), float(0.42 + inspiration + rng.normal(0, 0.01))),
        dome_k=float(rng.uniform(0.11, 0.15)),
        med_w=float(rng.uniform(0.085, 0.11)),
        med_shift=float(rng.normal(0, 0.01)),
        ctr=float(np.clip(rng.normal(0.45, 0.038), 0.36, 0.54)),
        heart_right=float(rng.uniform(0.27, 0.36)),
        heart_top=float(rng.normal(-0.15, 0.025)),
        habitus=float(np.clip(rng.lognormal(0.0, 0.18), 0.75, 1.6)),
        breast=float(rng.uniform(0.3, 1.0)) if sex == "F" else 0.0,
        bubble=float(rng.uniform(0.0, 1.0)),
        rib_dy=float(rng.uniform(0.1, 0.118)),
        rib_phase=float(rng.uniform(-0.3, 0.3)),
        tree_seed=int(rng.integers(0, 2**31 - 1)),
    )


def jitter_position(anat: Anatomy, rng: np.random.Generator) -> Anatomy:
    """The same patient positioned anew for a follow-up image (frame, rotation, inspiration)."""
    dy = float(rng.normal(0, 0.02))
    return anat.replace(
        shift=(float(rng.normal(0, 0.025)), float(rng.normal(0.03, 0.025))),
        rotation=float(rng.normal(0, 0.03)),
        scale=float(anat.scale * rng.uniform(0.97, 1.03)),
        dome_y=(anat.dome_y[0] + dy, anat.dome_y[1] + dy),
    )


class Geometry:
    """Analytic outlines of the lungs, domes, mediastinum and heart for one anatomy and view.

    ``heart`` holds the right-atrium and left-ventricle ellipses (cx, cy, ax, ay) whose union is
    the cardiac silhouette; its width is the CTR times the thoracic width (x 1.1 on AP views).

    Args:
        anat: the anatomy.
        view: ``PA`` or ``AP`` (AP: magnified heart, poorer inspiration).
    """

    def __init__(self, anat: Anatomy, view: str) -> None:
        self.a = anat
        self.ap = view == "AP"
        self.dome_y = (anat.dome_y[0] - 0.035 * self.ap, anat.dome_y[1] - 0.035 * self.ap)
        self.height = 0.5 * (self.dome_y[0] + self.dome_y[1]) - anat.apex_y
        hw = anat.ctr * 2.0 * anat.lung_w * (1.1 if self.ap else 1.0)
        xr = anat.med_shift - anat.heart_right * hw
        h = self.dome_y[1] + 0.06 - anat.heart_top
        self.heart = (
            (xr + 0.24 * hw, anat.heart_top + 0.62 * h, 0.24 * hw, 0.4 * h),
            (xr + 0.6 * hw, anat.heart_top + 0.66 * h, 0.4 * hw, 0.5 * h),
        )

    def heart_mask(self, x: Array, y: Array, edge: float) -> Array:
        """Soft mask of the heart shadow above the domes."""
        lobes = [disc(x, y, cx, cy, ax, ay, edge) for cx, cy, ax, ay in self.heart]
        return np.maximum(*lobes) * soft(self.dome(1, x) + 0.02 - y, edge)

    def lung_ellipse(self, s: int) -> tuple[float, float, float, float, float]:
        """(cx, cy, ax, ay_top, ay_bottom) of the lateral outline of lung ``s``."""
        a = self.a
        ax = 0.5 * a.lung_w
        cy = a.apex_y + 0.45 * self.height
        return a.med_shift * 0.5 + s * (a.lung_w - ax), cy, ax, 0.45 * self.height, 1.25 * self.height

    def lung_radius(self, s: int, x: Array, y: Array) -> Array:
        """Normalised radius of the lateral outline (1 on the chest wall)."""
        cx, cy, ax, ayt, ayb = self.lung_ellipse(s)
        ay = np.where(y < cy, ayt, ayb)
        return ellipse_r(x, y, cx, cy, ax, ay)

    def dome(self, s: int, x: Array) -> Array:
        """Height of hemidiaphragm ``s`` at x (the lung is above it)."""
        a = self.a
        u = (s * (x - a.med_shift) - 0.55 * a.lung_w) / (0.45 * a.lung_w)
        return self.dome_y[side_index(s)] + a.dome_k * (u**2 + 0.6 * np.clip(u, 0, None) ** 4)

    def medial(self, s: int, y: Array) -> Array:
        """Distance of the mediastinal border of side ``s`` from the midline at height y."""
        a = self.a
        upper = soft(a.heart_top + 0.05 - y, 0.05)
        width = a.med_w + a.med_widen * upper
        if s > 0:
            width = width + 0.04 * np.exp(-(((y - (a.heart_top - 0.28)) / 0.06) ** 2))
        return width

    def lung(self, s: int, x: Array, y: Array, edge: float) -> Array:
        """Soft mask of lung ``s`` (hemithorax above the dome, lateral of the mediastinum)."""
        cx, cy, ax, ayt, ayb = self.lung_ellipse(s)
        r = self.lung_radius(s, x, y)
        lateral = soft((1.0 - r) * np.where(y < cy, min(ax, ayt), ax), edge)
        return (
            lateral * soft(self.dome(s, x) - y, edge) * soft(s * (x - self.a.med_shift) - self.medial(s, y), 1.5 * edge)
        )

    def hilum(self, s: int) -> tuple[float, float]:
        """Position of the hilum of side ``s``."""
        a = self.a
        return a.med_shift + s * (a.med_w + 0.07), a.heart_top + 0.02 - 0.03 * (s > 0)

    def zone_y(self, frac: float) -> float:
        """Height at fraction ``frac`` of the way from apex (0) to dome (1)."""
        return self.a.apex_y + frac * self.height

    def lung_point(
        self, s: int, rng: np.random.Generator, zone: tuple[float, float], lateral: tuple[float, float] = (0.0, 1.0)
    ) -> tuple[float, float]:
        """A random point well inside lung ``s``.

        Args:
            s: side.
            rng: random generator.
            zone: vertical range as fractions of apex (0) to dome (1).
            lateral: horizontal range as fractions of mediastinum (0) to chest wall (1).
        """
        a = self.a
        ys = self.zone_y(zone[0]) + rng.random(48) * (zone[1] - zone[0]) * self.height
        frac = lateral[0] + rng.random(48) * (lateral[1] - lateral[0])
        xs = a.med_shift + s * (a.med_w + frac * (a.lung_w - a.med_w))
        inside = self.lung(s, xs, ys, 1e-3) > 0.9
        hx, hy = self.hilum(s)
        k = int(np.argmax(inside)) if inside.any() else 0
        return (float(xs[k]), float(ys[k])) if inside.any() else (hx + s * 0.15, hy)


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
        cx, cy = a.med_shift + 0.4 * a.lung_w, geo.dome(1, a.med_shift + 0.4 * a.lung_w) + 0.08
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


def rib_origin(a: Anatomy) -> float:
    """Height of the first posterior rib at the spine."""
    return a.apex_y - 0.1 + a.rib_phase * a.rib_dy


def rib_curve(geo: Geometry, u: Array, y: Array) -> Array:
    """Drop of a posterior rib at lateral distance ``u`` from the spine (steeper low in the chest)."""
    return -0.15 * u + (0.75 + 0.5 * np.clip((y - geo.a.apex_y) / geo.height, 0, 1)) * u**2


def rib_point(geo: Geometry, side: int, rib: int, u: float) -> tuple[float, float]:
    """Patient position of the centre of posterior rib ``rib`` at lateral distance ``u``."""
    a = geo.a
    y = rib_origin(a) + rib * a.rib_dy
    for _ in range(3):
        y = rib_origin(a) + rib * a.rib_dy + float(rib_curve(geo, np.array(u), np.array(y)))
    return a.med_shift + side * (u + 0.04), y


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
