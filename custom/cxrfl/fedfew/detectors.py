"""The UC detectors of stage 3 under one interface: the paper's dual prototypes behind the energy
gate, or the UC sites' scorers (see :data:`cxrfl.fedfew.config.DETECTORS`).

Every prediction carries a continuous ``score`` beside the decision ``positive``, so both kinds
are measured alike (:func:`cxrfl.nn.detection.detection_metrics`):

* ``paper``: the decision is "flagged by the energy AND nearer the positive prototype"; the score
  ranks every flagged image above every unflagged one, each group by the prototype margin
  (cosine-distance margins lie in [-2, 2], so an offset of 4 keeps the groups apart);
* ``scorer``: the decision is the scorers' vote; the score is their mean margin.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.prototypes import DualPrototype, PrototypeRefused, dual_prototype, predict_ucs
from cxrfl.fedfew.scorer import ScorerRefused, UCScorer, fit_scorer, score_ucs
from cxrfl.nn.detection import detection_metrics

Detector = DualPrototype | UCScorer
PAYLOAD_KEYS = {"paper": "prototypes", "scorer": "scorers"}
"""Detector kind -> the key its payloads travel and are stored under."""
_TYPES: dict[str, type[DualPrototype] | type[UCScorer]] = {"paper": DualPrototype, "scorer": UCScorer}
_GATE_OFFSET = 4.0


def parse_detector(kind: str, payload: Mapping[str, Any]) -> Detector:
    """One payload of one kind, validated whole.

    Args:
        kind: ``paper`` or ``scorer``.
        payload: the payload dict (it names its ``uc``).

    Raises:
        KeyError, TypeError, ValueError: a malformed payload.
    """
    return _TYPES[kind].from_payload(dict(payload))


def parse_detectors(kind: str, payloads: Sequence[Mapping[str, Any]]) -> dict[str, list[Detector]]:
    """Payloads of one kind, each validated whole (:func:`parse_detector`), grouped by UC.

    Args:
        kind: ``paper`` or ``scorer``.
        payloads: the payload dicts.
    """
    out: dict[str, list[Detector]] = {}
    for p in payloads:
        d = parse_detector(kind, p)
        out.setdefault(d.uc, []).append(d)
    return out


def detector_size(detector: Detector) -> int:
    """The feature dimension a detector works on."""
    return len(detector.positive) if isinstance(detector, DualPrototype) else len(detector.weights)


def predict(
    kind: str,
    features: np.ndarray,
    energies: np.ndarray,
    threshold: float,
    detectors: Mapping[str, Sequence[Detector]],
) -> dict[str, dict[str, Any]]:
    """Every UC's decisions and scores on images.

    Args:
        kind: ``paper`` or ``scorer``.
        features: [n, D] image features.
        energies: [n] joint energies (the ``paper`` gate).
        threshold: the energy threshold (``paper`` only).
        detectors: UC -> its detectors (UCs without one are left out).

    Returns:
        UC -> ``positive`` [n] bool, ``score`` [n], ``margin`` [n], ``votes`` [n], ``pairs``
        (and ``flagged`` [n] for ``paper``).
    """
    present = {uc: list(ds) for uc, ds in detectors.items() if ds}
    if kind == "scorer":
        out = {}
        for uc, ds in present.items():
            res = score_ucs(features, [d for d in ds if isinstance(d, UCScorer)])
            out[uc] = {**res, "score": res["margin"]}
        return out
    protos = {uc: [d for d in ds if isinstance(d, DualPrototype)] for uc, ds in present.items()}
    preds = predict_ucs(features, energies, threshold, protos)
    for res in preds.values():
        res["score"] = np.where(res["flagged"], res["margin"] + _GATE_OFFSET, res["margin"] - _GATE_OFFSET)
    return preds


def fit_detectors(
    kind: str,
    ucs: Sequence[str],
    features: np.ndarray,
    labels: Mapping[str, np.ndarray],
    config: FedFewConfig,
    site: str,
) -> dict[str, Any]:
    """A UC site's stage-3 answer: one detector per UC it labels, refused below the minimum.

    Args:
        kind: ``paper`` or ``scorer``.
        ucs: the site's UCs.
        features: [n, D] features of its training images.
        labels: UC -> [n] labels (1, 0, NaN unknown).
        config: ``min_prototype_images``, ``scorer_folds``, ``scorer_model``, ``seed``.
        site: the site's name (in the refusal reasons it keeps in its own log).

    Returns:
        ``{PAYLOAD_KEYS[kind]: [payload, ...], "refused": {uc: reason}}`` (nothing about a refused
        class's features leaves the site).
    """
    sent, refused = [], {}
    for uc in ucs:
        y = np.asarray(labels[uc], dtype=np.float64)
        try:
            if kind == "scorer":
                d: Detector = fit_scorer(
                    uc,
                    features,
                    y,
                    config.min_prototype_images,
                    folds=config.scorer_folds,
                    seed=config.seed,
                    model=config.scorer_model,
                )
            else:
                d = dual_prototype(uc, features, y, config.min_prototype_images)
        except (PrototypeRefused, ScorerRefused) as exc:
            refused[uc] = f"site {site}: {exc}"
            continue
        sent.append(d.to_payload())
    return {PAYLOAD_KEYS[kind]: sent, "refused": refused}


def evaluate_ucs(
    kind: str,
    features: np.ndarray,
    energies: np.ndarray,
    threshold: float,
    detectors: Mapping[str, Sequence[Detector]],
    labels: Mapping[str, np.ndarray],
    prevalence: Mapping[str, float | None],
) -> dict[str, dict[str, Any]]:
    """:func:`cxrfl.nn.detection.detection_metrics` of each UC that has labels and detectors.

    Args:
        kind: ``paper`` or ``scorer``.
        features: [n, D] features of the evaluated images.
        energies: [n] their joint energies.
        threshold: the energy threshold.
        detectors: UC -> its detectors.
        labels: UC -> [n] labels (1, 0, NaN unknown).
        prevalence: UC -> the share of positives to also report F1 and precision at (None: none).
    """
    ucs = {uc: ds for uc, ds in detectors.items() if uc in labels and ds}
    preds = predict(kind, features, energies, threshold, ucs) if ucs and len(features) else {}
    return {
        uc: detection_metrics(labels[uc], p["score"], p["positive"], prevalence=prevalence.get(uc))
        for uc, p in preds.items()
    }
