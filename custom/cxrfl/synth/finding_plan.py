"""The stage of an image's findings before its scene is built: the random choices and the anatomy.

Random choices (side, lobe, type, support devices, rib fractures) are made once in
:func:`plan_findings` so both stages agree; findings that change the anatomy itself (heart size,
mediastinal width, diaphragm height, volume loss, hyperinflation, rib fractures) act in
:func:`adjust_anatomy`. :mod:`cxrfl.synth.findings` then draws the rest into the scene.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from cxrfl.synth.anatomy import Anatomy, RibBreak, side_index

LOBES: dict[str, tuple[int, tuple[float, float], tuple[float, float]]] = {
    "RUL": (-1, (0.08, 0.4), (0.2, 0.9)),
    "RML": (-1, (0.5, 0.78), (0.05, 0.5)),
    "RLL": (-1, (0.6, 0.95), (0.2, 0.9)),
    "LUL": (1, (0.08, 0.42), (0.2, 0.9)),
    "lingula": (1, (0.45, 0.75), (0.45, 0.9)),
    "LLL": (1, (0.62, 0.95), (0.15, 0.8)),
}
"""Lobe -> (side, vertical zone apex..dome, lateral range mediastinum..wall)."""
_LOBE_NAMES = tuple(LOBES)
_LOBE_WEIGHTS = np.array([0.15, 0.12, 0.28, 0.13, 0.1, 0.22])


@dataclass
class Plan:
    """Random choices shared by the anatomy and drawing stages.

    Args:
        airspace_lobe: lobe of consolidation / pneumonia (kept together when both present).
        atelectasis: (kind, lobe) with kind ``plate`` or ``lobar``.
        effusion_sides: severities per side (image left, image right).
        pneumothorax_side: -1 or +1.
        devices: names of the support devices to draw.
        tube_side: side of a chest tube (the pneumothorax's or the larger effusion's).
        rib_breaks: fractures.
    """

    airspace_lobe: str
    atelectasis: tuple[str, str]
    effusion_sides: tuple[float, float]
    pneumothorax_side: int
    devices: tuple[str, ...]
    tube_side: int
    rib_breaks: tuple[RibBreak, ...]


def random_side(rng: np.random.Generator) -> int:
    """-1 or +1 with equal chance (one draw).

    Args:
        rng: random generator.
    """
    return -1 if rng.random() < 0.5 else 1


def _devices(sev: float, view: str, rng: np.random.Generator, effusion: bool, pneumothorax: bool) -> tuple[str, ...]:
    """Which support devices a patient has: bedside (AP) patients get ICU lines and tubes."""
    if view == "AP":
        probs = {
            "ecg": 0.65,
            "et_tube": 0.4,
            "ng_tube": 0.35,
            "central_line": 0.5,
            "chest_tube": 0.15,
            "pacemaker": 0.1,
            "sternal_wires": 0.1,
        }
        if effusion or pneumothorax:
            probs["chest_tube"] = 0.55
    else:
        probs = {"ecg": 0.15, "central_line": 0.3, "pacemaker": 0.35, "sternal_wires": 0.35, "port": 0.2}
    names = sorted(probs)
    chosen = [n for n in names if rng.random() < probs[n]]
    want = 1 + int(sev * 3.0)
    if not chosen:
        p = np.array([probs[n] for n in names])
        chosen = [names[int(rng.choice(len(names), p=p / p.sum()))]]
    return tuple(sorted(chosen[i] for i in rng.permutation(len(chosen))[:want]))


def plan_findings(findings: Mapping[str, float], anat: Anatomy, view: str, rng: np.random.Generator) -> Plan:
    """Make every random structural choice for this image's findings.

    Args:
        findings: canonical class -> severity of the present findings.
        anat: the patient.
        view: ``PA`` or ``AP``.
        rng: random generator.
    """
    lobe = _LOBE_NAMES[int(rng.choice(len(_LOBE_NAMES), p=_LOBE_WEIGHTS / _LOBE_WEIGHTS.sum()))]
    ate_kind = "plate" if rng.random() < 0.75 - 0.5 * findings.get("Atelectasis", 0.0) else "lobar"
    ate_lobe = ("RLL", "LLL", "RUL", "RML", "LUL")[int(rng.choice(5, p=[0.32, 0.38, 0.1, 0.12, 0.08]))]
    eff = findings.get("Pleural Effusion", 0.0)
    first, both = random_side(rng), rng.random() < 0.45
    sides = [0.0, 0.0]
    if eff:
        sides[side_index(first)] = eff
        if both:
            sides[side_index(-first)] = eff * rng.uniform(0.4, 1.0)
    ptx_side = random_side(rng)
    devices: tuple[str, ...] = ()
    if "Support Devices" in findings:
        devices = _devices(findings["Support Devices"], view, rng, bool(eff), "Pneumothorax" in findings)
    breaks: list[RibBreak] = []
    if "Fracture" in findings:
        sev = findings["Fracture"]
        s, k = random_side(rng), int(rng.integers(2, 8))
        u = float(rng.uniform(0.32, 0.6) * anat.lung_w)
        for j in range(1 + int(sev > 0.35) + int(sev > 0.7)):
            breaks.append(RibBreak(s, k + j, u + 0.02 * j, 0.3 + 0.6 * sev, 0.012 + 0.03 * sev))
    if "Pneumothorax" in findings:
        tube_side = ptx_side
    elif eff:
        tube_side = -1 if sides[0] >= sides[1] else 1
    else:
        tube_side = random_side(rng)
    return Plan(lobe, (ate_kind, ate_lobe), (sides[0], sides[1]), ptx_side, devices, tube_side, tuple(breaks))


def adjust_anatomy(anat: Anatomy, findings: Mapping[str, float], plan: Plan) -> Anatomy:
    """Apply the findings that change the anatomy itself.

    Args:
        anat: the patient's normal anatomy.
        findings: canonical class -> severity.
        plan: the random choices.
    """
    f = findings
    if "Emphysema" in f:
        sev = f["Emphysema"]
        anat = anat.replace(
            dome_y=(anat.dome_y[0] + 0.07 * sev, anat.dome_y[1] + 0.07 * sev),
            dome_k=anat.dome_k * (1.0 - 0.65 * sev),
            ctr=anat.ctr * (1.0 - 0.1 * sev),
            air=1.0 + 0.3 * sev,
            vessel_prune=0.75 * sev,
            lung_w=anat.lung_w + 0.02 * sev,
        )
    if "Fibrosis" in f:
        sev = f["Fibrosis"]
        anat = anat.replace(
            dome_y=(anat.dome_y[0] - 0.05 * sev, anat.dome_y[1] - 0.05 * sev), lung_w=anat.lung_w - 0.02 * sev
        )
    if "Cardiomegaly" in f:
        sev = f["Cardiomegaly"]
        anat = anat.replace(ctr=0.48 + 0.2 * sev, heart_right=anat.heart_right + 0.03 * sev)
    elif "Enlarged Cardiomediastinum" in f:
        anat = anat.replace(med_widen=0.03 + 0.1 * f["Enlarged Cardiomediastinum"])
    if "Atelectasis" in f and plan.atelectasis[0] == "lobar":
        sev = f["Atelectasis"]
        s = LOBES[plan.atelectasis[1]][0]
        anat = anat.with_dome(s, -(0.03 + 0.07 * sev)).replace(med_shift=anat.med_shift + s * (0.01 + 0.03 * sev))
    for s, sev in zip((-1, 1), plan.effusion_sides):
        if sev > 0.7:
            anat = anat.replace(med_shift=anat.med_shift - s * 0.08 * (sev - 0.7))
    if "Pneumothorax" in f and f["Pneumothorax"] > 0.75:
        s, sev = plan.pneumothorax_side, f["Pneumothorax"]
        anat = anat.with_dome(s, 0.12 * (sev - 0.75)).replace(med_shift=anat.med_shift - s * 0.12 * (sev - 0.75))
    if plan.rib_breaks:
        anat = anat.replace(rib_breaks=plan.rib_breaks)
    return anat
