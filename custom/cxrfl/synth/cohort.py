"""Who the patients of a synthetic site are: full 20-finding vectors with real co-occurrence.

The 14 NIH findings of an image are drawn as a whole real NIH label vector (the table of
:mod:`cxrfl.synth._nih_stats`, conditioned on PA/AP), so co-occurrence is NIH's own. A site's
case mix tilts that table (one odds multiplier per finding, fitted by iterative proportional
fitting) until the findings it names reach their target prevalence, keeping the co-occurrence
structure. The six CheXpert-only findings follow from the NIH ones and the view:
``Support Devices`` and ``Fracture`` by small logistic models (bedside AP images, effusion,
edema, pneumothorax ... raise them), and the parents by CheXpert's hierarchy
(``Lung Opacity`` = any opacity, ``Lung Lesion`` = nodule or mass, ``Enlarged
Cardiomediastinum`` implied by cardiomegaly, ``Pleural Other`` by pleural thickening), each
plus a small rate of its own. Follow-up images of a patient keep the previous finding vector
with some probability (NIH's persistence).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from cxrfl.data.labels import KNOWN_CLASSES, NIH_CLASSES
from cxrfl.synth import _nih_stats

EXTRA_CLASSES = (
    "Enlarged Cardiomediastinum",
    "Fracture",
    "Lung Lesion",
    "Lung Opacity",
    "Pleural Other",
    "Support Devices",
)
"""The CheXpert findings NIH does not annotate; with NIH_CLASSES they make KNOWN_CLASSES."""

_EXTRA_EFFECTS: dict[str, dict[str, float]] = {
    "Support Devices": {
        "AP": 2.0,
        "supine": 0.7,
        "Pleural Effusion": 0.8,
        "Edema": 0.8,
        "Pneumothorax": 1.2,
        "Atelectasis": 0.6,
        "Consolidation": 0.5,
        "Cardiomegaly": 0.4,
    },
    "Fracture": {"AP": 0.3, "Pneumothorax": 0.9, "Pleural Effusion": 0.3},
    "Enlarged Cardiomediastinum": {"AP": 0.5, "Edema": 0.4},
    "Lung Opacity": {"AP": 0.3},
    "Lung Lesion": {},
    "Pleural Other": {"Pleural Effusion": 0.4},
}
"""Log-odds effects on each extra finding's own events; intercepts are fitted per site."""

_PARENTS: dict[str, tuple[str, ...]] = {
    "Lung Opacity": (
        "Atelectasis",
        "Consolidation",
        "Edema",
        "Fibrosis",
        "Infiltration",
        "Mass",
        "Nodule",
        "Pneumonia",
    ),
    "Lung Lesion": ("Mass", "Nodule"),
    "Enlarged Cardiomediastinum": ("Cardiomegaly",),
    "Pleural Other": ("Pleural Thickening",),
}
"""CheXpert parent -> findings that imply it."""


@dataclass(frozen=True)
class CaseMix:
    """A site's patients: view mix, finding prevalences, severities.

    Args:
        ap_fraction: share of bedside AP images (the rest PA).
        supine_fraction: share of AP images taken lying down.
        prevalence: target prevalence of NIH findings (others follow NIH's co-occurrence).
        own_rates: target rates of the extra findings' own events (``Support Devices``,
            ``Fracture``; for the parents, events beyond those their children imply).
        severity: Beta(a, b) parameters of finding severities.
        persistence: probability that a follow-up image repeats the previous findings.
    """

    ap_fraction: float = 0.4
    supine_fraction: float = 0.3
    prevalence: tuple[tuple[str, float], ...] = ()
    own_rates: tuple[tuple[str, float], ...] = (
        ("Enlarged Cardiomediastinum", 0.02),
        ("Fracture", 0.03),
        ("Lung Lesion", 0.0),
        ("Lung Opacity", 0.03),
        ("Pleural Other", 0.01),
        ("Support Devices", 0.2),
    )
    severity: tuple[float, float] = (1.2, 1.6)
    persistence: float = 0.3

    @staticmethod
    def make(
        ap_fraction: float,
        prevalence: Mapping[str, float] | None = None,
        own_rates: Mapping[str, float] | None = None,
        **kw: object,
    ) -> CaseMix:
        """Build a case mix from plain dicts (sorted into tuples so it hashes stably).

        Args:
            ap_fraction: share of AP images.
            prevalence: NIH finding -> target prevalence.
            own_rates: extra finding -> own-event rate (missing ones keep the defaults).
            kw: other fields.
        """
        for name in prevalence or {}:
            if name not in NIH_CLASSES:
                raise ValueError(f"prevalence targets are for NIH findings; {name!r} is not one")
        rates = dict(CaseMix.own_rates)
        rates.update(own_rates or {})
        unknown = set(rates) - set(EXTRA_CLASSES)
        if unknown:
            raise ValueError(f"own_rates are for {', '.join(EXTRA_CLASSES)}; got {', '.join(sorted(unknown))}")
        return CaseMix(
            ap_fraction,
            prevalence=tuple(sorted((prevalence or {}).items())),
            own_rates=tuple(sorted(rates.items())),
            **kw,
        )  # type: ignore[arg-type]


@dataclass(frozen=True)
class Exam:
    """One image of a site.

    Args:
        patient: patient number (1-based, in order of appearance).
        study: study number of the patient (1-based; NIH follow-up # + 1).
        view: ``PA``, ``AP`` or ``LL`` (lateral).
        supine: lying patient.
        sex: ``M`` or ``F``.
        age: years.
        findings: present finding -> severity, over all 20 canonical classes.
    """

    patient: int
    study: int
    view: str
    supine: bool
    sex: str
    age: int
    findings: dict[str, float] = field(hash=False)


@lru_cache(maxsize=1)
def nih_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The embedded NIH label vectors: bits (k, 14) in NIH_CLASSES order, PA counts, AP counts."""
    codes, pa, ap = [], [], []
    for token in "".join(_nih_stats.COMBOS).split():
        c, p, a = token.split(":")
        codes.append(int(c, 16))
        pa.append(int(p))
        ap.append(int(a))
    bits = (np.array(codes)[:, None] >> np.arange(len(NIH_CLASSES))) & 1
    return bits.astype(np.float64), np.array(pa, dtype=np.float64), np.array(ap, dtype=np.float64)


def _odds(p: np.ndarray | float) -> np.ndarray | float:
    return p / (1.0 - p)


def tilt(mix: CaseMix) -> np.ndarray:
    """Log-weights per NIH label vector that make the site's target prevalences come true.

    Args:
        mix: the site's case mix.
    """
    bits, pa, ap = nih_table()
    base = (1 - mix.ap_fraction) * pa / pa.sum() + mix.ap_fraction * ap / ap.sum()
    log_m = np.zeros(len(NIH_CLASSES))
    targets = [(NIH_CLASSES.index(c), float(np.clip(t, 1e-4, 0.95))) for c, t in mix.prevalence]
    for _ in range(300):
        for j, t in targets:
            w = base * np.exp(bits @ log_m)
            p = float(np.clip((w * bits[:, j]).sum() / w.sum(), 1e-9, 1 - 1e-9))
            log_m[j] += np.log(_odds(t) / _odds(p))
    return bits @ log_m


def _sample_count(rng: np.random.Generator) -> int:
    counts = np.array(_nih_stats.IMAGES_PER_PATIENT, dtype=np.float64)
    k = int(rng.choice(len(counts), p=counts / counts.sum())) + 1
    return k if k < len(counts) else k + int(rng.integers(0, 5))


def _sample_age(rng: np.random.Generator) -> int:
    hist = np.array(_nih_stats.AGE_DECADES, dtype=np.float64)
    decade = int(rng.choice(len(hist), p=hist / hist.sum()))
    return int(np.clip(10 * decade + rng.integers(0, 10), 1, 95))


def _fit_intercept(logits: np.ndarray, target: float) -> float:
    """Intercept b with mean(sigmoid(b + logits)) == target (bisection)."""
    if target <= 0:
        return -np.inf
    lo, hi = -30.0, 30.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if np.mean(1.0 / (1.0 + np.exp(-(mid + logits)))) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def sample_cohort(mix: CaseMix, n_images: int, rng: np.random.Generator, lateral_fraction: float = 0.0) -> list[Exam]:
    """Draw a site's images: patients, studies, views and full finding vectors.

    Args:
        mix: the site's case mix.
        n_images: number of images (laterals included).
        rng: random generator.
        lateral_fraction: probability that a study also has a lateral image.
    """
    bits, pa, ap = nih_table()
    log_w = tilt(mix)
    probs = {}
    for view, counts in (("PA", pa), ("AP", ap)):
        w = counts * np.exp(log_w - log_w.max())
        probs[view] = w / w.sum()
    male = _nih_stats.MALE_FRACTION
    rows: list[tuple[int, int, str, bool, str, int, int, bool]] = []
    patient = 0
    while len(rows) < n_images:
        patient += 1
        sex, age = ("M" if rng.random() < male else "F"), _sample_age(rng)
        view, combo = "PA", 0
        for study in range(1, _sample_count(rng) + 1):
            copy = study > 1 and rng.random() < mix.persistence
            if study == 1 or rng.random() > 0.6:
                view = "AP" if rng.random() < mix.ap_fraction else "PA"
            supine = view == "AP" and rng.random() < mix.supine_fraction
            if not copy:
                combo = int(rng.choice(len(bits), p=probs[view]))
            age += int(rng.random() < 0.3)
            for v in (view, "LL") if rng.random() < lateral_fraction else (view,):
                if len(rows) < n_images:
                    rows.append((patient, study, v, supine, sex, min(age, 95), combo, copy))
    nih = bits[[r[6] for r in rows]]
    present = {c: nih[:, j].astype(bool) for j, c in enumerate(NIH_CLASSES)}
    is_ap = np.array([r[2] == "AP" for r in rows], dtype=np.float64)
    supine = np.array([r[3] for r in rows], dtype=np.float64)
    rates = dict(mix.own_rates)
    for name in sorted(_EXTRA_EFFECTS):
        effects = _EXTRA_EFFECTS[name]
        logits = np.zeros(len(rows))
        for k, beta in effects.items():
            logits += beta * (is_ap if k == "AP" else supine if k == "supine" else present[k])
        b = _fit_intercept(logits, rates.get(name, 0.0))
        own = rng.random(len(rows)) < 1.0 / (1.0 + np.exp(-(b + logits)))
        for child in _PARENTS.get(name, ()):
            own = own | present[child]
        present[name] = own
    a, b_ = mix.severity
    severity = np.clip(rng.beta(a, b_, (len(rows), len(KNOWN_CLASSES))), 0.03, 1.0)
    exams: list[Exam] = []
    for i, (pat, study, view, sup, sex, age, _, copy) in enumerate(rows):
        prev = exams[-1] if exams and exams[-1].patient == pat else None
        if prev is not None and (copy or view == "LL" and prev.study == study):
            findings = {
                c: float(np.clip(s + (0 if view == "LL" else rng.normal(0, 0.08)), 0.03, 1.0))
                for c, s in prev.findings.items()
            }
        else:
            findings = {c: float(severity[i, j]) for j, c in enumerate(KNOWN_CLASSES) if present[c][i]}
        if view == "LL" and prev is not None:
            sup = prev.supine
        exams.append(Exam(pat, study, view, sup, sex, age, findings))
    return exams
