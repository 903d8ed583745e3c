"""What a checkpoint carries for clinical use: per-class calibration maps and operating points.

Fitted by an evaluation-only run on the sites' validation splits (:mod:`cxrfl.fedeval`), written into
the checkpoint under ``clinical`` and read by ``cxrfl predict`` and the MONAI bundle. A threshold is
kept as a probability of the RAW model output (``raw >= threshold`` is positive), so a decision never
depends on the calibration map; its calibrated value is stored beside it for display.

A consortium's fit has one map per class, from the counts pooled over the sites labelling it. A site's
copy (:meth:`ClinicalFit.for_site`) keeps only the site's classes and, per class, whichever of the raw
scores, the consortium's map and a map fitted to the site's own validation counts fits those counts best
by Akaike's criterion (the own map pays for its parameters): hospitals differ in prevalence and
scanners, and one map cannot calibrate them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cxrfl.clinical.calibration import CalibrationMap, fit_calibration, log_loss, supported_calibration
from cxrfl.clinical.counts import ScoreCounts
from cxrfl.clinical.operating import choose_threshold
from cxrfl.errors import ConfigError

CHECKPOINT_KEY = "clinical"
"""The checkpoint entry holding :meth:`ClinicalFit.to_dict`."""


@dataclass(frozen=True)
class ClinicalFit:
    """Calibration maps and operating points of a model's classes (either may cover only some).

    Args:
        calibration: class -> its map.
        operating_points: class -> ``threshold`` (raw probability), ``calibrated_threshold``, ``target``,
            ``value``, ``met``, ``sensitivity``, ``specificity`` (reached on the fitting data).
        fitted_on: what they were fitted on (split, class -> positives, negatives and sites pooled).
    """

    calibration: dict[str, CalibrationMap]
    operating_points: dict[str, dict[str, Any]]
    fitted_on: dict[str, Any]

    @classmethod
    def fit(
        cls,
        pooled: Mapping[str, ScoreCounts],
        *,
        calibration: str | None,
        target: str | None,
        value: float | None,
        fitted_on: Mapping[str, Any],
        alpha: float = 0.05,
        rule: str = "new_data",
    ) -> ClinicalFit:
        """Fit from each class's pooled validation counts.

        Args:
            pooled: class -> merged counts (positives and negatives both present).
            calibration: ``platt``, ``temperature`` or None (no maps).
            target: ``sensitivity``, ``specificity``, ``youden`` or None (no operating points).
            value: the target sensitivity or specificity.
            fitted_on: provenance stored with the fit.
            alpha: a class's map is kept only where it beats the raw scores at this level
                (:func:`cxrfl.clinical.calibration.supported_calibration`).
            rule: how a target is read (:func:`cxrfl.clinical.operating.choose_threshold`).
        """
        maps, p_values, unfitted = _maps(pooled, calibration, alpha)
        points: dict[str, dict[str, Any]] = {}
        for c, counts in pooled.items():
            if target is None:
                break
            op = choose_threshold(counts, target, value, rule=rule)
            mapped = maps.get(c, CalibrationMap()).apply(np.array([op.point.threshold]))[0]
            sens, spec = op.point.sensitivity, op.point.specificity
            points[c] = {
                "threshold": op.point.threshold,
                "calibrated_threshold": float(mapped),
                "target": target,
                "value": value,
                "rule": rule,
                "met": op.met,
                "sensitivity": sens.value,
                "sensitivity_interval": [sens.low, sens.high],
                "specificity": spec.value,
                "specificity_interval": [spec.low, spec.high],
            }
        on = {**fitted_on, "calibration_p": p_values, **({"calibration_not_fitted": unfitted} if unfitted else {})}
        return cls(maps, points, on)

    def for_site(
        self,
        classes: Sequence[str],
        counts: Mapping[str, ScoreCounts],
        *,
        calibration: str | None,
        fitted_on: Mapping[str, Any],
    ) -> ClinicalFit:
        """A site's copy: its classes only, each with the map that fits the site's own validation counts best.

        Per class the candidates are the raw scores, the consortium's map and (with ``calibration``) a map
        fitted to the site's counts; the one of least ``2 * NLL + 2 * parameters fitted here`` is kept (AIC:
        the raw scores and the consortium's map fit nothing here), so a site keeps the raw scores where the
        consortium's map makes its own cases worse.

        Args:
            classes: the site's classes.
            counts: the site's own validation counts of each of its classes (a class it sent nothing for
                is absent: it keeps the consortium's map).
            calibration: ``platt``, ``temperature`` or None (no map of the site's own).
            fitted_on: provenance of the site's copy (the site's own case numbers, never another's).
        """
        maps = {c: m for c, m in self.calibration.items() if c in classes}
        chosen: dict[str, str] = {}
        for c, n in counts.items():
            if c not in classes:
                continue
            candidates = {"raw": (CalibrationMap(), 0), "consortium": (self.calibration.get(c), 0)}
            if calibration:
                try:
                    candidates["own"] = (fit_calibration(n, calibration), 2 if calibration == "platt" else 1)
                except ValueError:  # no finite map (perfectly separated scores): the other candidates stay
                    pass
            aic = {k: 2 * log_loss(n, m) + 2 * k_params for k, (m, k_params) in candidates.items() if m is not None}
            chosen[c] = min(aic, key=lambda k: aic[k])  # ties: the earlier (raw before consortium before own)
            maps.pop(c, None)
            picked = candidates[chosen[c]][0]
            if picked is not None and picked.kind != "identity":
                maps[c] = picked
        points = {  # the same raw thresholds; their calibrated values under the site's maps
            c: {**p, "calibrated_threshold": float(maps.get(c, CalibrationMap()).apply(np.array([p["threshold"]]))[0])}
            for c, p in self.operating_points.items()
            if c in classes
        }
        return ClinicalFit(maps, points, {**fitted_on, "site_calibration": chosen})

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint entry (JSON-safe)."""
        return {
            "calibration": {c: m.to_dict() for c, m in self.calibration.items()},
            "operating_points": self.operating_points,
            "fitted_on": self.fitted_on,
        }

    @classmethod
    def from_checkpoint(cls, checkpoint: Mapping[str, Any], where: str) -> ClinicalFit | None:
        """The fit a checkpoint carries (None: none), checked against its classes.

        Args:
            checkpoint: :func:`cxrfl.nn.models.load_checkpoint`'s dict.
            where: the file, for messages.

        Raises:
            ConfigError: a malformed entry (one line naming the file and the class).
        """
        entry = checkpoint.get(CHECKPOINT_KEY)
        if entry is None:
            return None
        classes = set(checkpoint["classes"])
        try:
            maps = {
                str(c): CalibrationMap.from_dict(m, where=f"{where}, class {c}")
                for c, m in entry["calibration"].items()
            }
            points = {str(c): dict(p) for c, p in entry["operating_points"].items()}
            bad = [c for c in [*maps, *points] if c not in classes]
            thresholds = [float(p["threshold"]) for p in points.values()]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(
                f"{where}: malformed '{CHECKPOINT_KEY}' entry ({type(exc).__name__}: {exc}); "
                "fit it again with an evaluation-only run (job_recipes/fedeval)"
            ) from None
        if bad or not all(0 < t < 1 for t in thresholds):
            raise ConfigError(
                f"{where}: '{CHECKPOINT_KEY}' names classes the model lacks {bad} or thresholds "
                "outside (0, 1); fit it again with an evaluation-only run (job_recipes/fedeval)"
            )
        return cls(maps, points, dict(entry.get("fitted_on") or {}))

    def calibrate(self, raw: np.ndarray, classes: Sequence[str]) -> np.ndarray:
        """Calibrated probabilities (a class without a map unchanged).

        Args:
            raw: [n, K] raw probabilities, columns in ``classes`` order.
            classes: the column names.
        """
        out = np.array(raw, dtype=float, copy=True)
        for j, c in enumerate(classes):
            if c in self.calibration:
                out[:, j] = self.calibration[c].apply(out[:, j])
        return out

    def decide(self, raw: np.ndarray, classes: Sequence[str]) -> list[dict[str, bool]]:
        """Positive or negative per class with an operating point, per row.

        Args:
            raw: [n, K] raw probabilities.
            classes: the column names.
        """
        cols = [
            (j, c, float(self.operating_points[c]["threshold"]))
            for j, c in enumerate(classes)
            if c in self.operating_points
        ]
        return [{c: bool(row[j] >= t) for j, c, t in cols} for row in np.atleast_2d(raw)]


def _maps(
    counts: Mapping[str, ScoreCounts], kind: str | None, alpha: float
) -> tuple[dict[str, CalibrationMap], dict[str, float], dict[str, str]]:
    """Per class the map kept (only those that are not the identity), the tests' p-values and the classes
    whose fit failed (e.g. perfectly separated scores: no finite map; the class keeps its raw scores).

    Args:
        counts: class -> validation counts.
        kind: ``platt``, ``temperature`` or None (no maps).
        alpha: the tests' level.
    """
    maps: dict[str, CalibrationMap] = {}
    p_values: dict[str, float] = {}
    unfitted: dict[str, str] = {}
    if not kind:
        return maps, p_values, unfitted
    for c, n in counts.items():
        try:
            m, p_values[c] = supported_calibration(n, kind, alpha=alpha)
        except ValueError as exc:
            unfitted[c] = str(exc)
            continue
        if m.kind != "identity":
            maps[c] = m
    return maps, p_values, unfitted
