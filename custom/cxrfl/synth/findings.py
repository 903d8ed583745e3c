"""The 20 findings drawn as their radiological signs, with severity in (0, 1].

Severity sets conspicuity and size together: at 0.1 a sign is hard to see even at full
resolution (a barely blunted costophrenic angle, a faint 6 mm nodule, a CTR of 0.52); at 1 it
is obvious. Findings that change the anatomy (heart size, mediastinal width, diaphragm height,
volume loss, hyperinflation, rib fractures) act in
:func:`cxrfl.synth.finding_plan.adjust_anatomy` before the scene is built; the rest edit the
scene's layers in :func:`draw_findings`. Random choices (side, lobe, type) are made once in
:func:`cxrfl.synth.finding_plan.plan_findings` so both stages agree.

CheXpert's parent classes are drawn through their children: ``Lung Opacity`` only adds its
own patchy opacity when no other opacity is present, ``Lung Lesion`` a nodule when neither
``Nodule`` nor ``Mass`` is, ``Pleural Other`` a calcified plaque when ``Pleural Thickening`` is
absent, and ``Enlarged Cardiomediastinum`` a widened upper mediastinum unless ``Cardiomegaly``
already enlarges the cardiac silhouette.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from cxrfl.data.labels import KNOWN_CLASSES
from cxrfl.synth.anatomy import rib_point, side_index
from cxrfl.synth.devices import draw_device
from cxrfl.synth.draw import Array, blur, disc, dome, segment_distance, smooth_noise, soft, stroke
from cxrfl.synth.finding_plan import LOBES, Plan, random_side
from cxrfl.synth.scene import Scene

OPACITIES = ("Atelectasis", "Consolidation", "Edema", "Fibrosis", "Infiltration", "Mass", "Nodule", "Pneumonia")
"""Findings that make ``Lung Opacity`` true (CheXpert's hierarchy)."""


def _add_fill(scene: Scene, value: Array) -> None:
    """Displace lung air by ``value`` (0..1), combined with what is already there."""
    scene.fill = 1.0 - (1.0 - scene.fill) * (1.0 - np.clip(value, 0.0, 1.0))


def _lobe_region(scene: Scene, lobe: str, radius: float, rng: np.random.Generator, edge: float) -> Array:
    """An irregular region of size ``radius`` inside ``lobe`` (fissure edge for the upper lobes)."""
    s, zone, lateral = LOBES[lobe]
    geo = scene.geo
    cx, cy = geo.lung_point(s, rng, zone, lateral)
    noise = smooth_noise(rng, scene.x.shape, 9)
    d = np.hypot(scene.x - cx, (scene.y - cy) / 1.25) + 0.035 * noise
    region = soft(radius - d, edge) * scene.lung[side_index(s)]
    if lobe in ("RUL", "LUL"):
        fissure = geo.hilum(s)[1] + 0.02
        region = region * soft(fissure - scene.y, scene.edge if lobe == "RUL" else 0.04)
    if lobe in ("RML", "lingula"):
        region = region * soft(scene.y - (geo.hilum(s)[1] + 0.01), scene.edge)
    return region


def _consolidation(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Dense lobar/segmental airspace opacity with air bronchograms (bronchi keep their air)."""
    region = _lobe_region(scene, plan.airspace_lobe, 0.07 + 0.17 * sev, rng, 0.012)
    _add_fill(scene, (0.55 + 0.42 * sev) * region * (1.0 - 0.9 * scene.bronchi))


def _pneumonia(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Patchy confluent airspace opacities in one lobe, some air bronchograms."""
    s, zone, lateral = LOBES[plan.airspace_lobe]
    cx, cy = scene.geo.lung_point(s, rng, zone, lateral)
    patch = np.zeros_like(scene.x)
    for _ in range(2 + int(4 * sev)):
        r = rng.uniform(0.03, 0.05 + 0.05 * sev)
        bx, by = cx + rng.normal(0, 0.07), cy + rng.normal(0, 0.08)
        patch = np.maximum(patch, disc(scene.x, scene.y, bx, by, r * 1.2, r, 0.025))
    amp = 0.3 + 0.5 * sev
    _add_fill(scene, amp * patch * scene.lung[side_index(s)] * (1.0 - 0.6 * scene.bronchi))


def _patchy(scene: Scene, sev: float, rng: np.random.Generator, amp: float) -> None:
    """Ill-defined patchy opacities in the mid/lower zones of one or both lungs."""
    noise = smooth_noise(rng, scene.x.shape, 11)
    patch = soft(noise - (1.3 - 0.7 * sev), 0.35)
    s = random_side(rng)
    weight = scene.lung[side_index(s)] + (scene.lung[side_index(-s)] if rng.random() < 0.5 else 0.0)
    zone = soft(scene.y - scene.geo.zone_y(rng.uniform(0.2, 0.5)), 0.08)
    _add_fill(scene, amp * patch * weight * zone)


def _infiltration(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Ill-defined patchy opacities."""
    _patchy(scene, sev, rng, 0.25 + 0.4 * sev)


def _lung_opacity(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """A parenchymal opacity of its own (only when no more specific opacity is present)."""
    _patchy(scene, sev, rng, 0.2 + 0.4 * sev)


def _edema(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Bilateral perihilar haze (bat wing), blurred and upper-zone vessels, Kerley B lines."""
    haze = np.zeros_like(scene.x)
    for s in (-1, 1):
        hx, hy = scene.geo.hilum(s)
        sx, sy = 0.16 + 0.12 * sev, 0.2 + 0.12 * sev
        haze += (
            np.exp(-(((scene.x - hx - s * 0.04) / sx) ** 2) - ((scene.y - hy - 0.04) / sy) ** 2)
            * scene.lung[side_index(s)]
        )
    _add_fill(scene, (0.08 + 0.5 * sev) * haze)
    scene.vessel_gain = scene.vessel_gain * (1.0 + 0.6 * sev * soft(scene.geo.hilum(-1)[1] - scene.y, 0.1))
    scene.vessels = blur(scene.vessels, 1.5 * sev * 0.012 / scene.px)
    for s in (-1, 1):
        for _ in range(int(3 + 8 * sev)):
            y = scene.geo.zone_y(rng.uniform(0.72, 0.95))
            wall = scene.geo.a.med_shift + s * scene.geo.a.lung_w * rng.uniform(0.9, 0.97)
            length = rng.uniform(0.03, 0.06)
            pts = np.array([[wall, y], [wall - s * length, y + rng.normal(0, 0.004)]])
            stroke(scene.dense, scene.grid, pts, 0.004, 1.2 * sev)


def _atelectasis(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Plate-like (discoid) bands, or a collapsed lobe's wedge (volume loss in adjust_anatomy)."""
    kind, lobe = plan.atelectasis
    s = LOBES[lobe][0]
    geo = scene.geo
    if kind == "plate":
        for _ in range(1 + int(rng.random() < 0.4)):
            cx, cy = geo.lung_point(s, rng, (0.62, 0.88), (0.3, 0.8))
            half, tilt = 0.06 + 0.1 * sev, rng.normal(0, 0.12)
            d = segment_distance(scene.x, scene.y, (cx - half, cy - tilt * half), (cx + half, cy + tilt * half))
            band = soft(0.006 + 0.012 * sev - d, scene.edge * 1.5)
            _add_fill(scene, (0.6 + 0.35 * sev) * band * scene.lung[side_index(s)])
        return
    hx, hy = geo.hilum(s)
    a = geo.a
    lower = lobe in ("RLL", "LLL", "RML")
    if lower:
        base_y = geo.dome(s, a.med_shift + s * 0.3 * a.lung_w)
        tip = (a.med_shift + s * (a.med_w + (0.25 if lobe == "RML" else 0.35) * a.lung_w * (0.6 + 0.6 * sev)), base_y)
        wedge = _triangle(scene, (hx, hy - 0.02), tip, (a.med_shift + s * a.med_w, base_y + 0.05))
    else:
        top = geo.zone_y(0.02)
        wedge = _triangle(
            scene, (hx, hy), (a.med_shift + s * a.med_w, top), (a.med_shift + s * a.lung_w * (0.4 + 0.4 * sev), top)
        )
    _add_fill(scene, (0.5 + 0.45 * sev) * wedge * scene.lung[side_index(s)])


def _triangle(scene: Scene, p0: tuple[float, float], p1: tuple[float, float], p2: tuple[float, float]) -> Array:
    """Soft mask of a triangle."""
    out = np.ones_like(scene.x)
    pts = (p0, p1, p2)
    cx, cy = (p0[0] + p1[0] + p2[0]) / 3, (p0[1] + p1[1] + p2[1]) / 3
    for i in range(3):
        (ax, ay), (bx, by) = pts[i], pts[(i + 1) % 3]
        nx, ny = by - ay, ax - bx
        norm = np.hypot(nx, ny)
        sign = 1.0 if (cx - ax) * nx + (cy - ay) * ny > 0 else -1.0
        out = out * soft(sign * ((scene.x - ax) * nx + (scene.y - ay) * ny) / norm, 0.012)
    return out


def _nodule(scene: Scene, sev: float, rng: np.random.Generator, count: int) -> None:
    for _ in range(count):
        s = random_side(rng)
        cx, cy = scene.geo.lung_point(s, rng, (0.1, 0.9), (0.15, 0.9))
        r = 0.025 + 0.05 * (0.5 * rng.random() + 0.5 * sev)
        density = 0.15 + 0.4 * sev
        scene.dense += (
            density
            * np.sqrt(dome(scene.x, scene.y, cx, cy, r, r))
            * soft(r - np.hypot(scene.x - cx, scene.y - cy), scene.edge)
        )


def _nodules(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """One to three round opacities < 3 cm."""
    _nodule(scene, sev, rng, 1 + int(rng.random() < 0.25) + int(rng.random() < 0.1))


def _lung_lesion(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """A nodule (only when neither Nodule nor Mass is present)."""
    _nodule(scene, sev, rng, 1)


def _mass(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """A lobulated opacity >= 3 cm, peripheral or hilar."""
    s = random_side(rng)
    if rng.random() < 0.25:
        hx, hy = scene.geo.hilum(s)
        cx, cy = hx + s * 0.06, hy + rng.normal(0, 0.04)
    else:
        cx, cy = scene.geo.lung_point(s, rng, (0.1, 0.85), (0.25, 0.85))
    r = 0.075 + 0.1 * sev + 0.03 * rng.random()
    mask = np.zeros_like(scene.x)
    for _ in range(3):
        lx, ly, lr = cx + rng.normal(0, 0.3 * r), cy + rng.normal(0, 0.3 * r), r * rng.uniform(0.55, 0.85)
        mask = np.maximum(mask, disc(scene.x, scene.y, lx, ly, lr, lr * rng.uniform(0.85, 1.15), scene.edge * 2))
    _add_fill(scene, (0.5 + 0.4 * sev) * mask)
    scene.dense += (0.05 + 0.12 * sev) * mask


def _pleural_effusion(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Basal fluid with a meniscus rising laterally, blunted costophrenic angle, obscured dome;
    on supine images a graded veil over the hemithorax instead."""
    geo = scene.geo
    a = geo.a
    for s, side_sev in zip((-1, 1), plan.effusion_sides):
        if side_sev <= 0:
            continue
        lung = scene.lung[side_index(s)]
        wall_x = a.med_shift + s * a.lung_w * 0.97
        cp_y = float(geo.dome(s, np.array(wall_x)))
        lateral = np.clip(s * (scene.x - a.med_shift) / a.lung_w, 0.0, 1.0)
        if scene.supine:
            grade = soft(scene.y - geo.zone_y(0.3), 0.25)
            _add_fill(scene, (0.15 + 0.5 * side_sev) * grade * lung)
            h = 0.02 + 0.1 * side_sev
        else:
            h = 0.03 + 0.5 * side_sev**1.3
        top = cp_y - h * (0.45 + 0.55 * lateral**2)
        fluid = soft(scene.y - top, 0.01 + 0.025 * side_sev)
        band = soft(lateral - (1.0 - 0.04 - 0.08 * side_sev), 0.02) * soft(scene.y - (top - 0.15 * side_sev), 0.05)
        _add_fill(scene, np.maximum(fluid, 0.6 * band) * lung)
        scene.soft += 0.2 * fluid * lung


def _pneumothorax(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Collapsed lung with a thin visceral pleural line and no markings beyond it (apical or
    lateral); on supine images a hyperlucent base (deep sulcus)."""
    s = plan.pneumothorax_side
    geo = scene.geo
    a = geo.a
    lung = scene.lung[side_index(s)]
    if scene.supine:
        region = lung * soft(scene.y - geo.zone_y(0.55), 0.08) * np.clip(s * (scene.x - a.med_shift) / a.lung_w, 0, 1)
        scene.air_gain += (0.2 + 0.5 * sev) * region
        scene.vessel_gain *= 1.0 - 0.7 * region
        return
    c = 0.06 + 0.4 * sev**1.1
    anchor_x, anchor_y = a.med_shift + s * a.med_w, float(geo.dome(s, np.array(a.med_shift + s * 0.5 * a.lung_w)))
    apical = rng.random() < 0.6
    kx, ky = (c * 0.5, c) if apical else (c, c * 0.6)
    xs = anchor_x + (scene.x - anchor_x) / (1.0 - kx)
    ys = anchor_y + (scene.y - anchor_y) / (1.0 - ky)
    collapsed = geo.lung(s, xs, ys, 0.6 * scene.px + 0.001)
    space = lung * (1.0 - collapsed)
    scene.vessel_gain *= 1.0 - space
    scene.air_gain += (0.25 + 0.2 * sev) * space
    _add_fill(scene, 0.15 * c * collapsed * lung)
    line = 4.0 * collapsed * (1.0 - collapsed) * lung**6
    scene.dense += (0.05 + 0.08 * sev) * line


def _emphysema(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Bullae in the upper zones (hyperlucency, pruned vessels, flat domes in adjust_anatomy)."""
    if sev < 0.4:
        return
    for _ in range(1 + int(rng.random() < sev) + int(rng.random() < sev - 0.4)):
        s = random_side(rng)
        cx, cy = scene.geo.lung_point(s, rng, (0.05, 0.4), (0.3, 0.95))
        r = rng.uniform(0.04, 0.05 + 0.08 * sev)
        bulla = disc(scene.x, scene.y, cx, cy, r, r * 0.9, scene.edge) * scene.lung[side_index(s)]
        scene.vessel_gain *= 1.0 - bulla
        scene.air_gain += 0.3 * bulla
        scene.dense += 0.04 * 4.0 * bulla * (1.0 - bulla)


def _fibrosis(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Basal, peripheral reticular (net-like) pattern (volume loss in adjust_anatomy)."""
    geo = scene.geo
    a = geo.a
    coarse = smooth_noise(rng, scene.x.shape, 7)
    fine = smooth_noise(rng, scene.x.shape, 20 * scene.x.shape[1] / 128)
    net = np.exp(-((fine / 0.45) ** 2))
    weight = soft(scene.y - geo.zone_y(0.45 - 0.2 * sev), 0.1) * (
        0.35 + 0.65 * np.clip(np.abs(scene.x - a.med_shift) / a.lung_w, 0, 1)
    )
    weight = weight * soft(coarse + 0.8, 0.4)
    _add_fill(scene, (0.3 + 0.6 * sev) * net * weight * scene.lungs() + 0.15 * sev * weight * scene.lungs())


def _pleural_band(scene: Scene, sev: float, rng: np.random.Generator) -> None:
    """Smooth pleural thickening along the chest wall or as an apical cap."""
    geo = scene.geo
    sides = (random_side(rng),) if rng.random() < 0.6 else (-1, 1)
    apical = rng.random() < 0.4
    for s in sides:
        cx, cy, ax, ayt, _ = geo.lung_ellipse(s)
        r = geo.lung_radius(s, scene.x, scene.y)
        thick = (0.02 + 0.06 * sev) * (1.0 + 0.3 * smooth_noise(rng, scene.x.shape, 6))
        band = soft(r - (1.0 - thick / ax), scene.edge * 2)
        if apical:
            band = band * soft(geo.zone_y(0.22) - scene.y, 0.04)
        else:
            y0 = geo.zone_y(rng.uniform(0.25, 0.5))
            band = band * soft(scene.y - y0, 0.04) * soft(y0 + rng.uniform(0.25, 0.45) - scene.y, 0.04)
        band = band * scene.lung[side_index(s)]
        _add_fill(scene, band)
        scene.dense += (0.05 + 0.1 * sev) * band


def _pleural_thickening(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Smooth pleural band along the chest wall or as an apical cap."""
    _pleural_band(scene, sev, rng)


def _pleural_other(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Calcified pleural plaques: irregular bright patches on the chest wall or the domes."""
    geo = scene.geo
    a = geo.a
    for _ in range(1 + int(3 * sev * rng.random())):
        s = random_side(rng)
        if rng.random() < 0.6:
            y = geo.zone_y(rng.uniform(0.35, 0.85))
            x = a.med_shift + s * a.lung_w * 0.95
            ax, ay = 0.015 + 0.015 * sev, 0.05 + 0.06 * sev
        else:
            x = a.med_shift + s * a.lung_w * rng.uniform(0.3, 0.7)
            y = float(geo.dome(s, np.array(x))) - 0.01
            ax, ay = 0.05 + 0.06 * sev, 0.014
        plaque = disc(scene.x, scene.y, x, y, ax, ay, scene.edge) * soft(
            smooth_noise(rng, scene.x.shape, 30) + 0.6, 0.3
        )
        scene.dense += (0.25 + 0.4 * sev) * plaque


def _hernia(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Round retrocardiac opacity, usually with an air-fluid level."""
    geo = scene.geo
    a = geo.a
    r = 0.07 + 0.09 * sev
    cx, cy = a.med_shift + 0.05, geo.dome_y[1] - 0.02 - 0.4 * r
    body = disc(scene.x, scene.y, cx, cy, r * 1.15, r, scene.edge * 2)
    if rng.random() < 0.7:
        level = cy + rng.uniform(-0.3, 0.2) * r
        gas = body * soft(level - scene.y, scene.edge)
        scene.soft += (0.12 + 0.18 * sev) * body - (0.3 + 0.3 * sev) * gas
        scene.dense += 0.06 * 4 * body * (1 - body)
    else:
        scene.soft += (0.12 + 0.2 * sev) * body


def _fracture(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """The interrupted, offset ribs are drawn with the ribs; most fractures also show callus
    (healing) or an extrapleural hematoma along the chest wall (acute)."""
    a = scene.geo.a
    if rng.random() < 0.6:
        for br in plan.rib_breaks:
            x, y = rib_point(scene.geo, br.side, br.rib, br.u)
            scene.dense += (0.15 + 0.25 * sev) * disc(scene.x, scene.y, x, y, 0.05, 0.035, 0.008)
    else:
        br = plan.rib_breaks[0]
        _, y = rib_point(scene.geo, br.side, br.rib, br.u)
        wall = a.med_shift + br.side * a.lung_w
        lens = (
            disc(scene.x, scene.y, wall, y, 0.03 + 0.05 * sev, 0.08 + 0.06 * sev, 0.01)
            * scene.lung[side_index(br.side)]
        )
        _add_fill(scene, (0.5 + 0.4 * sev) * lens)


def _enlarged_cardiomediastinum(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Drawn in :func:`cxrfl.synth.finding_plan.adjust_anatomy` (wider mediastinum); nothing to add."""


def _cardiomegaly(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    """Drawn in :func:`cxrfl.synth.finding_plan.adjust_anatomy` (larger cardiothoracic ratio); nothing to add."""


def _support_devices(scene: Scene, sev: float, plan: Plan, rng: np.random.Generator) -> None:
    for name in plan.devices:
        draw_device(scene, name, rng, plan.tube_side, 0.45 + 0.55 * sev)


_DRAW: dict[str, Callable[[Scene, float, Plan, np.random.Generator], None]] = {
    "Atelectasis": _atelectasis,
    "Cardiomegaly": _cardiomegaly,
    "Consolidation": _consolidation,
    "Edema": _edema,
    "Emphysema": _emphysema,
    "Enlarged Cardiomediastinum": _enlarged_cardiomediastinum,
    "Fibrosis": _fibrosis,
    "Fracture": _fracture,
    "Hernia": _hernia,
    "Infiltration": _infiltration,
    "Lung Lesion": _lung_lesion,
    "Lung Opacity": _lung_opacity,
    "Mass": _mass,
    "Nodule": _nodules,
    "Pleural Effusion": _pleural_effusion,
    "Pleural Other": _pleural_other,
    "Pleural Thickening": _pleural_thickening,
    "Pneumonia": _pneumonia,
    "Pneumothorax": _pneumothorax,
    "Support Devices": _support_devices,
}
assert tuple(sorted(_DRAW)) == KNOWN_CLASSES


def drawn_by_children(name: str, findings: Mapping[str, float]) -> bool:
    """Whether a CheXpert parent class is already shown by a more specific present finding."""
    if name == "Lung Opacity":
        return any(c in findings for c in OPACITIES)
    if name == "Lung Lesion":
        return "Nodule" in findings or "Mass" in findings
    if name == "Pleural Other":
        return "Pleural Thickening" in findings
    if name == "Enlarged Cardiomediastinum":
        return "Cardiomegaly" in findings
    return False


def draw_findings(scene: Scene, findings: Mapping[str, float], plan: Plan, rng: np.random.Generator) -> None:
    """Draw every present finding's sign into the scene, in a fixed (sorted) order.

    Args:
        scene: the scene (edited in place).
        findings: canonical class -> severity in (0, 1].
        plan: the random choices made by :func:`cxrfl.synth.finding_plan.plan_findings`.
        rng: random generator.
    """
    for name in KNOWN_CLASSES:
        if name in findings and not drawn_by_children(name, findings):
            _DRAW[name](scene, float(findings[name]), plan, rng)
