"""A patient's chest anatomy and its analytic outlines.

:class:`Anatomy` holds one patient's proportions (thorax size, inspiration, heart size,
mediastinum, habitus, rib spacing, the seed of the vessel tree); follow-up images of a
patient reuse it with a new position in the frame. :class:`Geometry` gives the outlines of the
lungs, domes, mediastinum, heart and ribs for one view; :func:`cxrfl.synth.scene.build_scene`
turns both into the layered scene every frontal image is rendered from.

Side convention: ``s = -1`` is image left (the patient's right lung), ``s = +1`` image right
(the patient's left lung, next to the heart).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from cxrfl.synth.draw import Array, disc, ellipse_r, soft

SIDES = (-1, 1)


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
