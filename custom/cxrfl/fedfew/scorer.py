"""A UC scorer: a class-balanced linear detector that a UC site fits on its own images.

Why (docs/fedfew.md): the paper's energy gate does not separate a UC's positives from its
negatives, while the stage-2 features do. So for each UC it labels, a site fits a logistic
regression on the features of its training images, positives AND negatives, with the classes
weighted equally (``class_weight="balanced"``: 20 positives count as much as 400 negatives) and
the L2 strength chosen by inner cross-validated AUROC (``LogisticRegressionCV``). Its decision
threshold maximises balanced accuracy on out-of-fold scores
(``TunedThresholdClassifierCV``), so the threshold is never chosen on the images it was fitted
on. The dual prototype is a special case (a linear rule ``d(x, p-) - d(x, p+)``).

What leaves the site is the fitted rule only: one weight per feature (the standardisation folded
in), a bias, the threshold, the image counts and the out-of-fold balanced accuracy; like a
prototype, it is refused when fewer than ``min_images`` positives or negatives stand behind it.
Nothing per image leaves, and the server sends a site only the scorers of its own UCs.

Inference: each scorer's margin is ``w . x + b - threshold`` (> 0: positive); with several
sites' scorers of one UC, each votes and the majority decides, a tie by the mean margin
(:func:`cxrfl.fedfew.prototypes.vote`). The detection score (for AUROC) is the mean margin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegressionCV
from sklearn.model_selection import StratifiedKFold, TunedThresholdClassifierCV
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from cxrfl.errors import CxrflError
from cxrfl.fedfew.prototypes import vote

C_GRID = (1e-3, 1e-2, 1e-1, 1.0)
"""Inverse L2 strengths tried by the inner cross-validation (features are standardised)."""


class ScorerRefused(CxrflError):
    """A site will not send a scorer: too few images behind it."""


@dataclass(frozen=True)
class UCScorer:
    """One site's linear detector of one UC.

    Args:
        uc: the class name.
        weights: [D] weights on the raw (unstandardised) features.
        bias: the intercept.
        threshold: the decision threshold on ``weights . x + bias``.
        n_positive: positives it was fitted on.
        n_negative: negatives it was fitted on.
        cv_balanced_accuracy: balanced accuracy of the threshold on out-of-fold scores.
        source: anonymous index of the sending site (0, 1, ... per UC).
    """

    uc: str
    weights: np.ndarray
    bias: float
    threshold: float
    n_positive: int
    n_negative: int
    cv_balanced_accuracy: float
    source: int = 0

    def margin(self, features: np.ndarray) -> np.ndarray:
        """``w . x + b - threshold`` of each row of ``features`` [n, D] (> 0: positive)."""
        return np.atleast_2d(np.asarray(features, np.float64)) @ self.weights.astype(np.float64) + (
            self.bias - self.threshold
        )

    def to_payload(self) -> dict[str, Any]:
        """JSON-friendly dict (what travels to the server and is stored in the model file)."""
        return {
            "uc": self.uc,
            "weights": np.asarray(self.weights, np.float32).tolist(),
            "bias": float(self.bias),
            "threshold": float(self.threshold),
            "n_positive": int(self.n_positive),
            "n_negative": int(self.n_negative),
            "cv_balanced_accuracy": float(self.cv_balanced_accuracy),
            "source": int(self.source),
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any], source: int | None = None) -> UCScorer:
        """Rebuild from :meth:`to_payload` output, validated whole (finite numbers, non-empty).

        Args:
            d: the dict.
            source: overrides the stored source index.
        """
        w = np.asarray(d["weights"], np.float32).ravel()
        numbers = np.asarray([d["bias"], d["threshold"], d["cv_balanced_accuracy"]], np.float64)
        if w.size == 0:
            raise ValueError(f"scorer of {d.get('uc')!r} has no weights")
        if not (np.isfinite(w).all() and np.isfinite(numbers).all()):
            raise ValueError(f"scorer of {d.get('uc')!r} holds non-finite values")
        return cls(
            str(d["uc"]),
            w,
            float(numbers[0]),
            float(numbers[1]),
            int(d["n_positive"]),
            int(d["n_negative"]),
            float(numbers[2]),
            int(d.get("source", 0) if source is None else source),
        )


def _model(folds: int, seed: int) -> TunedThresholdClassifierCV:
    inner = StratifiedKFold(folds, shuffle=True, random_state=seed)
    outer = StratifiedKFold(folds, shuffle=True, random_state=seed + 1)
    logistic = LogisticRegressionCV(
        Cs=list(C_GRID),
        l1_ratios=(0.0,),
        use_legacy_attributes=False,
        cv=inner,
        scoring="roc_auc",
        class_weight="balanced",
        max_iter=2000,
    )
    return TunedThresholdClassifierCV(
        make_pipeline(StandardScaler(), logistic),
        scoring="balanced_accuracy",
        response_method="decision_function",
        cv=outer,
        store_cv_results=True,
    )


def fit_scorer(
    uc: str, features: np.ndarray, labels: np.ndarray, min_images: int, *, folds: int = 5, seed: int = 0
) -> UCScorer:
    """The site-side fit of one UC's scorer.

    Args:
        uc: the class.
        features: [n, D] features of the site's training images.
        labels: [n] labels of ``uc``: 1, 0, or NaN (unknown: left out).
        min_images: fewest positives and negatives behind a scorer (at least ``folds``, so that
            every fold holds both).
        folds: cross-validation folds (threshold and L2 strength).
        seed: seed of the fold assignment.

    Raises:
        ScorerRefused: fewer than ``max(min_images, folds)`` positives or negatives (nothing is
            computed from them).
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64).ravel()
    if x.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"features {x.shape} and labels {y.shape} do not match")
    known = ~np.isnan(y)
    x, y = x[known], y[known].astype(int)
    need = max(min_images, folds)
    n_pos, n_neg = int(y.sum()), int((y == 0).sum())
    short = [f"{n} {kind}" for n, kind in ((n_pos, "positive"), (n_neg, "negative")) if n < need]
    if short:
        raise ScorerRefused(
            f"class {uc!r}: only {' and '.join(short)} training image(s); a scorer needs at least {need} "
            "(fedfew.min_prototype_images, and one per cross-validation fold) so that it never describes a "
            "single patient; not sent"
        )
    model = _model(folds, seed).fit(x, y)
    pipe: Pipeline = model.estimator_
    scaler, logistic = pipe[0], pipe[-1]
    weights = logistic.coef_[0] / scaler.scale_
    bias = float(logistic.intercept_[0] - weights @ scaler.mean_)
    return UCScorer(
        uc, weights.astype(np.float32), bias, float(model.best_threshold_), n_pos, n_neg, float(model.best_score_)
    )


def score_ucs(features: np.ndarray, scorers: Sequence[UCScorer]) -> dict[str, Any]:
    """The scorers of one UC on images: majority vote, ties by the mean margin.

    Args:
        features: [n, D] features.
        scorers: the UC's scorers (at least one).

    Returns:
        ``positive`` [n] bool, ``votes`` [n], ``pairs`` (number of scorers), ``margin`` [n] the
        mean margin (the detection score).
    """
    if not scorers:
        raise ValueError("no scorers to apply")
    return vote(np.stack([s.margin(features) for s in scorers]))
