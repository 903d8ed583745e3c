"""Dual prototypes of an underrepresented class and the nearest-prototype matching.

For a UC c held by a site, the site computes two prototypes from its own training images:
the mean feature vector of its positives of c and the mean of its negatives (the paper's
``p_c^+`` and ``p_c^-``, features of the stage-2 feature extractor). Only these means leave
the site, and only when each is averaged over at least ``min_images`` images: a mean of one
or two images would describe individual patients, so the site refuses to send it
(:class:`PrototypeRefused`).

Inference: an image flagged by the energy threshold is matched, for each UC, to the nearer of
the two prototypes by cosine distance (positive when closer to ``p_c^+``); when several sites
sent prototypes of the same UC, each pair votes and the majority decides (a tie goes to the
sum of the distance margins).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cxrfl.errors import CxrflError


class PrototypeRefused(CxrflError):
    """A site will not send a prototype: too few images behind it."""


@dataclass(frozen=True)
class DualPrototype:
    """The two prototypes of one UC from one site.

    Args:
        uc: the class name.
        positive: mean feature of the site's positive training images [D].
        negative: mean feature of its negative training images [D].
        n_positive: images averaged into ``positive``.
        n_negative: images averaged into ``negative``.
        source: anonymous index of the sending site (0, 1, ... per UC).
    """

    uc: str
    positive: np.ndarray
    negative: np.ndarray
    n_positive: int
    n_negative: int
    source: int = 0

    def to_payload(self) -> dict[str, Any]:
        """JSON-friendly dict (what travels to the server and is stored in the model file)."""
        return {
            "uc": self.uc,
            "positive": np.asarray(self.positive, np.float32).tolist(),
            "negative": np.asarray(self.negative, np.float32).tolist(),
            "n_positive": int(self.n_positive),
            "n_negative": int(self.n_negative),
            "source": int(self.source),
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any], source: int | None = None) -> DualPrototype:
        """Rebuild from :meth:`to_payload` output (lists or arrays/tensors).

        Args:
            d: the dict.
            source: overrides the stored source index.
        """
        pos = np.asarray(_as_array(d["positive"]), np.float32).ravel()
        neg = np.asarray(_as_array(d["negative"]), np.float32).ravel()
        if pos.shape != neg.shape or pos.size == 0:
            raise ValueError(
                f"prototype of {d.get('uc')!r}: positive {pos.shape} and negative {neg.shape} must be equal, non-empty"
            )
        if not (np.isfinite(pos).all() and np.isfinite(neg).all()):
            raise ValueError(f"prototype of {d.get('uc')!r} holds non-finite values")
        return cls(
            str(d["uc"]),
            pos,
            neg,
            int(d["n_positive"]),
            int(d["n_negative"]),
            int(d.get("source", 0) if source is None else source),
        )


def _as_array(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):
        return v.detach().cpu().numpy()
    return np.asarray(v)


def dual_prototype(uc: str, features: np.ndarray, labels: np.ndarray, min_images: int) -> DualPrototype:
    """The site-side computation: mean features of the positives and of the negatives of ``uc``.

    Args:
        uc: the class.
        features: [n, D] features of the site's training images.
        labels: [n] labels of ``uc``: 1, 0, or NaN (unknown: left out).
        min_images: fewest images behind each prototype.

    Raises:
        PrototypeRefused: fewer than ``min_images`` positives or negatives (the message says how
            many there are and how many are needed; nothing is computed from them).
    """
    features = np.asarray(features, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64).ravel()
    if features.ndim != 2 or features.shape[0] != labels.shape[0]:
        raise ValueError(f"features {features.shape} and labels {labels.shape} do not match")
    pos, neg = labels == 1.0, labels == 0.0
    n_pos, n_neg = int(pos.sum()), int(neg.sum())
    short = [f"{n} {kind}" for n, kind in ((n_pos, "positive"), (n_neg, "negative")) if n < min_images]
    if short:
        raise PrototypeRefused(
            f"class {uc!r}: only {' and '.join(short)} training image(s); a prototype needs at least "
            f"{min_images} images (fedfew.min_prototype_images) so that it never describes a single patient; "
            "not sent"
        )
    return DualPrototype(
        uc, features[pos].mean(axis=0).astype(np.float32), features[neg].mean(axis=0).astype(np.float32), n_pos, n_neg
    )


def cosine_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``1 - cos(a, b)`` along the last axis (broadcasting; a zero vector has distance 1).

    Args:
        a: [..., D].
        b: [..., D].
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    na = np.linalg.norm(a, axis=-1)
    nb = np.linalg.norm(b, axis=-1)
    denom = na * nb
    cos = np.divide((a * b).sum(axis=-1), denom, out=np.zeros(np.broadcast_shapes(na.shape, nb.shape)), where=denom > 0)
    return 1.0 - cos


def match_prototypes(features: np.ndarray, prototypes: Sequence[DualPrototype]) -> dict[str, np.ndarray]:
    """Nearest-prototype votes for one UC, majority over the sites that sent a pair.

    Args:
        features: [n, D] features of the images to classify.
        prototypes: the pairs of one UC (at least one).

    Returns:
        ``positive`` [n] bool (majority of votes, ties broken by the summed margin),
        ``votes`` [n] number of pairs voting positive, ``pairs`` (int), ``margin`` [n]
        mean of ``d(x, p-) - d(x, p+)`` over the pairs (> 0: closer to the positive prototype).
    """
    if not prototypes:
        raise ValueError("no prototypes to match")
    features = np.atleast_2d(np.asarray(features, dtype=np.float64))
    margins = np.stack(
        [
            cosine_distance(features, p.negative[None, :]) - cosine_distance(features, p.positive[None, :])
            for p in prototypes
        ]
    )  # [pairs, n]
    return vote(margins)


def vote(margins: np.ndarray) -> dict[str, Any]:
    """Majority of several detectors' votes on each image, a tie decided by the summed margin.

    Args:
        margins: [detectors, n] margins (> 0: that detector votes positive).

    Returns:
        ``positive`` [n] bool, ``votes`` [n] positive votes, ``pairs`` (number of detectors),
        ``margin`` [n] the mean margin.
    """
    margins = np.atleast_2d(margins)
    votes = (margins > 0).sum(axis=0)
    pairs = margins.shape[0]
    total = margins.sum(axis=0)
    positive = np.where(2 * votes == pairs, total > 0, 2 * votes > pairs)
    return {"positive": positive, "votes": votes, "pairs": pairs, "margin": total / pairs}


def predict_ucs(
    features: np.ndarray, energies: np.ndarray, threshold: float, prototypes: Mapping[str, Sequence[DualPrototype]]
) -> dict[str, dict[str, np.ndarray]]:
    """FedFew's UC predictions: energy above the threshold, then the nearer prototype.

    Args:
        features: [n, D] image features.
        energies: [n] joint energies.
        threshold: the energy threshold (flagged when ``E > threshold``).
        prototypes: UC -> its prototype pairs.

    Returns:
        UC -> ``positive`` [n] bool, ``flagged`` [n] bool, ``votes`` [n], ``pairs``, ``margin`` [n].
    """
    energies = np.asarray(energies, dtype=np.float64).ravel()
    flagged = energies > threshold
    out = {}
    for uc, pairs in prototypes.items():
        m = match_prototypes(features, pairs)
        out[uc] = {**m, "flagged": flagged, "positive": flagged & m["positive"]}
    return out
