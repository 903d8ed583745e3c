"""A UC scorer: a class-balanced linear detector that a UC site fits on its own images.

Why (docs/fedfew.md): the paper's energy gate does not separate a UC's positives from its
negatives, while the stage-2 features do. So for each UC it labels, a site fits a logistic
regression on the features of its training images, positives AND negatives, with the classes
weighted equally (``class_weight="balanced"``: 20 positives count as much as 400 negatives) and
the L2 strength chosen by inner cross-validated AUROC (``LogisticRegressionCV``); or, with
``scorer_model: prototype``, the dual prototype's cosine margin (:class:`CosinePrototypes`), which
tunes nothing on ~20 positives but its threshold. Its decision
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
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.linear_model import LogisticRegressionCV
from sklearn.model_selection import StratifiedKFold, TunedThresholdClassifierCV
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler, normalize

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
        unit_input: the rule reads each image's features scaled to unit length (the prototype rule's cosine).
    """

    uc: str
    weights: np.ndarray
    bias: float
    threshold: float
    n_positive: int
    n_negative: int
    cv_balanced_accuracy: float
    source: int = 0
    unit_input: bool = False

    def margin(self, features: np.ndarray) -> np.ndarray:
        """``w . x + b - threshold`` of each row of ``features`` [n, D] (> 0: positive; ``x`` at unit length
        with ``unit_input``)."""
        x = np.atleast_2d(np.asarray(features, np.float64))
        if self.unit_input:
            x = normalize(x)
        return x @ self.weights.astype(np.float64) + (self.bias - self.threshold)

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
            "unit_input": bool(self.unit_input),
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
            bool(d.get("unit_input", False)),
        )


class CosinePrototypes(ClassifierMixin, BaseEstimator):
    """The dual prototype as a linear rule: ``cos(x, p+) - cos(x, p-) = x/|x| . (p+/|p+| - p-/|p-|)``.

    ``p+`` and ``p-`` are the mean features of the positives and of the negatives, as
    :func:`cxrfl.fedfew.prototypes.dual_prototype` takes them.
    """

    def fit(self, x: np.ndarray, y: np.ndarray) -> CosinePrototypes:
        """Take the two means; ``coef_`` [D] is the margin's weight on unit-length features."""
        self.classes_ = np.unique(y)
        self.coef_ = (
            normalize(x[y == 1].mean(axis=0, keepdims=True))[0] - normalize(x[y == 0].mean(axis=0, keepdims=True))[0]
        )
        return self

    def decision_function(self, x: np.ndarray) -> np.ndarray:
        """The cosine margin of each row."""
        return normalize(np.asarray(x, np.float64)) @ self.coef_


def _model(folds: int, seed: int, kind: str) -> TunedThresholdClassifierCV:
    """The rule (``kind``: :data:`cxrfl.fedfew.config.SCORER_MODELS`), its threshold tuned on out-of-fold scores."""
    outer = StratifiedKFold(folds, shuffle=True, random_state=seed + 1)
    if kind == "prototype":
        rule: Pipeline | CosinePrototypes = CosinePrototypes()
    elif kind == "logistic":
        logistic = LogisticRegressionCV(
            Cs=list(C_GRID),
            l1_ratios=(0.0,),
            use_legacy_attributes=False,
            cv=StratifiedKFold(folds, shuffle=True, random_state=seed),
            scoring="roc_auc",
            class_weight="balanced",
            max_iter=2000,
        )
        rule = make_pipeline(StandardScaler(), logistic)
    else:
        raise ValueError(f"unknown scorer model {kind!r}")
    return TunedThresholdClassifierCV(
        rule,
        scoring="balanced_accuracy",
        response_method="decision_function",
        cv=outer,
        store_cv_results=True,
    )


def fit_scorer(
    uc: str,
    features: np.ndarray,
    labels: np.ndarray,
    min_images: int,
    *,
    folds: int = 5,
    seed: int = 0,
    model: str = "logistic",
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
        model: the rule, ``logistic`` or ``prototype`` (:data:`cxrfl.fedfew.config.SCORER_MODELS`).

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
    tuned = _model(folds, seed, model).fit(x, y)
    fitted = tuned.estimator_
    if isinstance(fitted, CosinePrototypes):
        weights, bias, unit = fitted.coef_, 0.0, True
    else:
        scaler, logistic = fitted[0], fitted[-1]
        weights = logistic.coef_[0] / scaler.scale_  # the standardisation folded in
        bias, unit = float(logistic.intercept_[0] - weights @ scaler.mean_), False
    threshold, cv_score = float(tuned.best_threshold_), float(tuned.best_score_)
    return UCScorer(uc, weights.astype(np.float32), bias, threshold, n_pos, n_neg, cv_score, unit_input=unit)


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
