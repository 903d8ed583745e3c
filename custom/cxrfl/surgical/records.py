"""What the surgical server records: scored-model curve points, round records.

Pure functions of the sites' answers, kept apart from :class:`cxrfl.surgical.server.SurgicalServer`'s
control flow. Their keys are the schema of ``cxrfl/rounds.jsonl`` (``tests/test_output_schema.py``);
``cxrfl/evaluation.json`` is written by :mod:`cxrfl.surgical.evaluation`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cxrfl.common.transport import Message
from cxrfl.core.update_change import change_fields
from cxrfl.surgical.round_aggregator import RoundResult


def curve_point(model_round: int, answers: Mapping[str, Message], loss_key: str, auroc_key: str) -> dict[str, Any]:
    """The scores of one model: the sites' validation loss and mean AUROC, and their means.

    Args:
        model_round: the round the scored model comes from.
        answers: the sites' answers.
        loss_key: the metric holding the validation loss.
        auroc_key: the metric holding the mean validation AUROC.
    """
    metrics = {s: m.get("metrics") or {} for s, (_, m) in sorted(answers.items())}
    losses = {s: m.get(loss_key) for s, m in metrics.items()}
    aurocs = {s: m.get(auroc_key) for s, m in metrics.items()}
    return {
        "round": model_round,
        "mean_val_loss": finite_mean(losses.values()),
        "mean_val_auroc": finite_mean(aurocs.values()),
        "site_val_loss": losses,
        "site_val_auroc": aurocs,
    }


def round_record(
    rnd: int,
    phase: str,
    sent: Sequence[str],
    answers: Mapping[str, Message],
    result: RoundResult | None,
    rejected: Mapping[str, str],
) -> dict[str, Any]:
    """The ``rounds.jsonl`` record of one warm-up or round attempt.

    Args:
        rnd: the round (0: the warm-up).
        phase: ``warmup`` or ``train``.
        sent: the sites that were sent a task.
        answers: the sites' answers.
        result: the aggregate (None: the attempt failed).
        rejected: site -> why its result was rejected.
    """
    return {
        "round": rnd,
        "phase": phase,
        "sites_answered": sorted(answers),
        "sites_failed": sorted(set(sent) - set(answers)),
        "sites_aggregated": list(result.sites) if result else [],
        "contributors": result.contributors if result else {},
        "rejected": dict(rejected),
        "aggregated": result is not None,
        **change_fields(result.changes if result else {}),
        "site_metrics": {s: dict(m.get("metrics") or {}) for s, (_, m) in sorted(answers.items())},
    }


def finite_mean(values: Any) -> float:
    """The mean of the finite values (None and NaN left out); NaN when there are none."""
    finite = [float(v) for v in values if v is not None and np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def fmt(v: float | None) -> str:
    """A score for the operator log (``n/a`` when missing or not finite)."""
    return "n/a" if v is None or not np.isfinite(v) else f"{v:.4f}"
