"""Render one synthetic chest radiograph from a full finding vector.

Frontal views (PA/AP) go through the layered scene of :mod:`cxrfl.synth.scene` and the signs
of :mod:`cxrfl.synth.findings`; lateral views use a simpler side-on model of the same patient
(sternum, spine, superimposed lungs, heart, domes) showing the findings that matter on a
lateral: heart size, posterior effusion, opacities and devices.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from cxrfl.data.labels import KNOWN_CLASSES
from cxrfl.synth.anatomy import Anatomy, sample_anatomy
from cxrfl.synth.draw import Array, Grid, blur, disc, segment_distance, smooth_noise, soft, stroke
from cxrfl.synth.finding_plan import adjust_anatomy, plan_findings
from cxrfl.synth.findings import OPACITIES, draw_findings
from cxrfl.synth.scene import build_scene
from cxrfl.synth.styles import AcquisitionStyle, acquire, get_style

VIEWS = ("PA", "AP", "LL")


def _check(findings: Mapping[str, float], view: str) -> dict[str, float]:
    if view not in VIEWS:
        raise ValueError(f"view {view!r} is not one of {', '.join(VIEWS)}")
    out = {}
    for name, sev in findings.items():
        if name not in KNOWN_CLASSES:
            raise ValueError(f"unknown finding {name!r}; use the canonical names of cxrfl.data.labels.KNOWN_CLASSES")
        if not 0.0 < float(sev) <= 1.0:
            raise ValueError(f"severity of {name!r} must be in (0, 1], got {sev}")
        out[name] = float(sev)
    return out


def _lateral(anat: Anatomy, findings: Mapping[str, float], rng: np.random.Generator, height: int, width: int) -> Array:
    """Attenuation of a lateral view (patient facing image left, spine on the right)."""
    grid = Grid(height, width, anat.scale, anat.shift, anat.rotation * 0.5)
    x, y = grid.coords()
    edge = 0.6 * grid.px + 0.002
    f = findings
    emph = f.get("Emphysema", 0.0)
    base = 0.5 * (anat.dome_y[0] + anat.dome_y[1]) + 0.07 * emph
    front = -0.62 - 0.04 * anat.habitus + 0.05 * (y - 0.1) ** 2
    back = 0.78 + 0.04 * anat.habitus
    body = soft(x - front, edge * 3) * soft(back - x, edge * 3)
    att = 0.6 * anat.habitus * body
    for arm in (-0.25, 0.1):
        att = att + 0.2 * disc(x, y, arm, anat.apex_y - 0.15, 0.16, 0.45, 0.05)
    dome = base - 0.1 * (1 - 0.6 * emph) + (0.14 * (1 - 0.5 * emph)) * np.clip((x + 0.5) / 1.1, 0, 1) ** 2
    lung = disc(x, y, -0.02, -0.08, 0.57, 0.68, edge * 2) * soft(dome - y, edge) * soft(x - front - 0.05, edge)
    ctr = anat.ctr if "Cardiomegaly" not in f else 0.48 + 0.2 * f["Cardiomegaly"]
    hr = 0.3 + 0.7 * (ctr - 0.45)
    heart = disc(x, y, -0.42 + hr * 0.8, base - 0.14, hr * 1.1, hr, edge * 2) * soft(dome + 0.02 - y, edge)
    fill = np.zeros_like(x)
    if "Pleural Effusion" in f:
        sev = f["Pleural Effusion"]
        level = base + 0.12 - (0.05 + 0.4 * sev) * (0.3 + 0.7 * np.clip((x + 0.2) / 0.9, 0, 1))
        fill = np.maximum(fill, soft(y - level, 0.015))
    present = [c for c in OPACITIES if c in f] + [c for c in ("Lung Opacity", "Lung Lesion") if c in f]
    for name in present:
        sev = f[name]
        r = 0.015 + 0.04 * sev if name in ("Nodule", "Lung Lesion") else 0.04 + 0.12 * sev
        cx, cy = rng.uniform(-0.35, 0.5), rng.uniform(anat.apex_y + 0.15, base - 0.05)
        fill = np.maximum(fill, (0.35 + 0.55 * sev) * disc(x, y, cx, cy, r * 1.2, r, 0.02))
    depth = lung * (0.55 + 0.45 * np.sqrt(np.clip(1 - ((x + 0.02) / 0.57) ** 2, 0, 1))) * (1.0 - 0.75 * heart)
    att = att + 0.4 * heart + 0.3 * soft(y - dome, edge) * body
    att = att - 0.5 * (1.0 + 0.3 * emph) * depth * (1.0 - np.clip(fill, 0, 1))
    hilum = np.exp(-(((x - 0.12) / 0.1) ** 2) - ((y - (anat.heart_top + 0.02)) / 0.12) ** 2)
    att = att + 0.08 * hilum * lung
    spine = soft(0.075 - np.abs(x - 0.62), edge) * soft(y - (anat.apex_y - 0.4), 0.05)
    period = 0.085
    discs = np.exp(-(((np.mod(y, period) - period / 2) / 0.009) ** 2))
    att = att + 0.45 * spine * (1.0 - 0.6 * discs)
    sternum = soft(0.014 - np.abs(x - front - 0.03), edge) * soft(0.3 - np.abs(y + 0.15), 0.05)
    att = att + 0.18 * sternum
    att = att - 0.25 * soft(0.028 - segment_distance(x, y, (0.0, -1.4), (0.14, anat.heart_top - 0.05)), edge)
    vessels = blur(np.clip(smooth_noise(rng, x.shape, 20), 0, None), 0.5) * lung * (1 - fill) * 0.025
    att = att + vessels
    if "Support Devices" in f:
        layer = np.zeros_like(x)
        stroke(layer, grid, np.array([[0.02, -1.4], [0.12, anat.heart_top - 0.12]]), 0.01, 2.0)
        att = att + blur(layer, 0.5)
    return np.clip(att, 0.0, None)


def render_cxr(
    findings: Mapping[str, float],
    style: AcquisitionStyle | str,
    rng: np.random.Generator,
    size: int,
    *,
    view: str = "PA",
    supine: bool = False,
    anatomy: Anatomy | None = None,
    aspect: float = 1.0,
) -> np.ndarray:
    """Render a chest radiograph showing exactly the given findings.

    Args:
        findings: canonical class -> severity in (0, 1] for each present finding (all others absent).
        style: the site's acquisition style (or its name in :data:`cxrfl.synth.styles.STYLES`).
        rng: random generator (the only source of randomness: same state, same pixels). It is
            split into independent streams for anatomy, signs and acquisition, so the same
            generator state with and without a finding gives the same patient, noise and text.
        size: image width in pixels.
        view: ``PA``, ``AP`` (bedside) or ``LL`` (lateral).
        supine: lying patient (AP only: effusion layers, ``SUPINE`` stamp).
        anatomy: the patient (random if None); pass the same one for a patient's follow-ups.
        aspect: image height / width.

    Returns:
        uint8 array (height, width), bright = dense.
    """
    sev = _check(findings, view)
    style = get_style(style)
    height = max(int(round(size * aspect)), 1)
    anat_rng, sign_rng, acq_rng = rng.spawn(3)
    anat = anatomy if anatomy is not None else sample_anatomy(anat_rng)
    if view == "LL":
        att = _lateral(anat, sev, sign_rng, height, size)
    else:
        plan = plan_findings(sev, anat, view, sign_rng)
        scene = build_scene(adjust_anatomy(anat, sev, plan), height, size, view, supine and view == "AP")
        draw_findings(scene, sev, plan, sign_rng)
        att = scene.attenuation()
    return acquire(att, style, acq_rng, view, supine)
