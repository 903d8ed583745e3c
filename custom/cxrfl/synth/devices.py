"""Support devices: tubes, lines, ECG leads, pacemakers, ports and sternal wires.

Radio-opaque devices are thin, very dense curves; they are drawn with their physical width, so
at small image sizes they become faint, as real lines do on downsampled radiographs.
"""

from __future__ import annotations

import numpy as np

from cxrfl.synth.draw import Array, bezier, blur, disc, stroke
from cxrfl.synth.scene import Scene

DEVICES = ("central_line", "chest_tube", "ecg", "et_tube", "ng_tube", "pacemaker", "port", "sternal_wires")


def _offset(points: Array, d: float) -> Array:
    """The polyline shifted sideways by ``d`` (along its normals)."""
    tangent = np.gradient(points, axis=0)
    tangent /= np.maximum(np.hypot(tangent[:, 0], tangent[:, 1]), 1e-12)[:, None]
    return points + d * np.stack([-tangent[:, 1], tangent[:, 0]], 1)


def _tube(
    layer: Array, scene: Scene, control: list[tuple[float, float]], half: float, density: float, stripe: bool = True
) -> None:
    """A tube: two walls (and a radio-opaque stripe) along a Bezier curve."""
    pts = bezier(np.array(control), 80)
    for d in (-half, half):
        stroke(layer, scene.grid, _offset(pts, d), 0.004, density)
    if stripe:
        stroke(layer, scene.grid, _offset(pts, 0.4 * half), 0.004, 1.5 * density)


def _line(layer: Array, scene: Scene, control: list[tuple[float, float]], width: float, density: float) -> None:
    stroke(layer, scene.grid, bezier(np.array(control), 80), width, density)


def _et_tube(layer: Array, scene: Scene, rng: np.random.Generator, tube_side: int) -> None:
    a = scene.geo.a
    tip = a.heart_top - 0.1 - rng.uniform(0.03, 0.12)  # above the carina
    mx, top = a.med_shift, a.apex_y
    _tube(layer, scene, [(mx + 0.06, top - 0.55), (mx + 0.01, top - 0.2), (mx * 0.7, tip)], 0.011, 2.0)


def _ng_tube(layer: Array, scene: Scene, rng: np.random.Generator, tube_side: int) -> None:
    a = scene.geo.a
    mx, top, ht, dome = a.med_shift, a.apex_y, a.heart_top, scene.geo.dome_y[1]
    control = [
        (mx + 0.03, top - 0.55),
        (mx + 0.02, ht),
        (mx + 0.05, dome + 0.05),
        (mx + 0.3, dome + 0.05),
        (mx + 0.28, dome + 0.18),
    ]
    _line(layer, scene, control, 0.007, 2.0)


def _central_line(layer: Array, scene: Scene, rng: np.random.Generator, tube_side: int) -> None:
    a = scene.geo.a
    mx, top, ht = a.med_shift, a.apex_y, a.heart_top
    tip = (mx - 0.045, ht + rng.uniform(-0.02, 0.1))
    if rng.random() < 0.6:
        control = [(mx - 0.18, top - 0.5), (mx - 0.12, top), (mx - 0.06, ht - 0.1), tip]
    else:
        control = [(mx + 0.65, top + 0.02), (mx + 0.2, top + 0.02), (mx - 0.04, ht - 0.15), tip]
    _line(layer, scene, control, 0.005, 1.8)


def _port(layer: Array, scene: Scene, rng: np.random.Generator, tube_side: int) -> None:
    a = scene.geo.a
    mx, top, ht = a.med_shift, a.apex_y, a.heart_top
    s = -1 if rng.random() < 0.6 else 1
    px, py = mx + s * 0.35, top + 0.14
    layer += 0.7 * disc(scene.x, scene.y, px, py, 0.035, 0.03, scene.edge)
    control = [(px, py), (mx - 0.08, top + 0.05), (mx - 0.05, ht - 0.05), (mx - 0.045, ht + 0.05)]
    _line(layer, scene, control, 0.005, 1.5)


def _pacemaker(layer: Array, scene: Scene, rng: np.random.Generator, tube_side: int) -> None:
    a = scene.geo.a
    mx, top, ht = a.med_shift, a.apex_y, a.heart_top
    s = 1 if rng.random() < 0.8 else -1
    bx, by = mx + s * 0.45, top + 0.12
    r4 = ((scene.x - bx) / 0.075) ** 4 + ((scene.y - by) / 0.05) ** 4
    layer += 1.6 * np.clip(1.5 * (1.0 - r4), 0.0, 1.0)
    (cx0, cy0, _, _), (cx1, cy1, _, _) = scene.geo.heart
    for tip in ((cx0, cy0 - 0.1), (cx1 - 0.05, cy1 + 0.08)):
        _line(layer, scene, [(bx, by), (mx - 0.1 * s, top + 0.12), (mx - 0.06, ht), tip], 0.007, 2.5)


def _sternal_wires(layer: Array, scene: Scene, rng: np.random.Generator, tube_side: int) -> None:
    a = scene.geo.a
    for k in range(int(rng.integers(4, 7))):
        wy = a.heart_top - 0.2 + 0.08 * k
        outer = disc(scene.x, scene.y, a.med_shift, wy, 0.03, 0.012, scene.edge)
        inner = disc(scene.x, scene.y, a.med_shift, wy, 0.022, 0.006, scene.edge)
        layer += 1.2 * np.clip(outer - inner, 0.0, 1.0)


def _ecg(layer: Array, scene: Scene, rng: np.random.Generator, tube_side: int) -> None:
    geo, mx = scene.geo, scene.geo.a.med_shift
    for _ in range(int(rng.integers(3, 6))):
        ex = mx + rng.uniform(-1, 1) * geo.a.lung_w * 1.05
        ey = geo.zone_y(rng.uniform(-0.1, 1.0))
        ring = disc(scene.x, scene.y, ex, ey, 0.028, 0.028, scene.edge) - disc(
            scene.x, scene.y, ex, ey, 0.02, 0.02, scene.edge
        )
        layer += 0.35 * np.clip(ring, 0, 1) + 1.2 * disc(scene.x, scene.y, ex, ey, 0.008, 0.008, scene.edge)
        end = (np.sign(ex - mx + 1e-9) * 1.4, ey + rng.uniform(-0.6, 0.6))
        mid = (0.5 * (ex + end[0]) + rng.normal(0, 0.2), 0.5 * (ey + end[1]) + rng.normal(0, 0.2))
        _line(layer, scene, [(ex, ey), mid, end], 0.004, 1.4)


def _chest_tube(layer: Array, scene: Scene, rng: np.random.Generator, tube_side: int) -> None:
    a, s = scene.geo.a, tube_side
    mx, dome = a.med_shift, scene.geo.dome_y[0 if s < 0 else 1]
    control = [
        (mx + s * (a.lung_w + 0.2), dome - 0.02),
        (mx + s * (a.lung_w - 0.02), dome - 0.12),
        (mx + s * 0.55 * a.lung_w, a.apex_y + 0.12),
    ]
    _tube(layer, scene, control, 0.014, 1.4)


_DRAW = {
    "central_line": _central_line,
    "chest_tube": _chest_tube,
    "ecg": _ecg,
    "et_tube": _et_tube,
    "ng_tube": _ng_tube,
    "pacemaker": _pacemaker,
    "port": _port,
    "sternal_wires": _sternal_wires,
}
"""Each device's drawing (into a layer, in scene coordinates; the random draws in the order they always had)."""


def draw_device(scene: Scene, name: str, rng: np.random.Generator, tube_side: int, visibility: float = 1.0) -> None:
    """Draw one device into ``scene.dense``.

    Args:
        scene: the scene (edited in place).
        name: one of :data:`DEVICES`.
        rng: random generator.
        tube_side: side of a chest tube (-1 image left, +1 image right).
        visibility: density factor (thin, faint catheters ... obvious metal).
    """
    draw = _DRAW.get(name)
    if draw is None:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    layer = np.zeros_like(scene.x)
    draw(layer, scene, rng, tube_side)
    scene.dense += visibility * blur(layer, 0.5)
