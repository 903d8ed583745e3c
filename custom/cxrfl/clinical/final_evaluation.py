"""The selected model on every site's test split at the end of a training run, pooled like an evaluation-only run.

Used by surgical aggregation and its baselines (:mod:`cxrfl.surgical.evaluation`) and by cyclical weight
transfer (:mod:`cxrfl.cwt.evaluation`). Each site scores the model it receives (surgical: the feature
extractor and its own head rows) and answers its
own metrics (loss, per-class AUROC) and, per class it labels, binned counts of its positives' and
negatives' scores (:mod:`cxrfl.clinical.counts`; nothing below the minimum cell size). The server
pools the counts per class over exactly the sites that label it, with the same code as the
evaluation-only federation (:mod:`cxrfl.clinical.pooling`): the pooled AUROC with its interval, the
sensitivity and specificity at a threshold, and the calibration. Personalized FL (local heads) has no
global model to pool: its sites answer their own metrics only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cxrfl.clinical.counts import BinSpec, count_request
from cxrfl.clinical.pooling import PooledEvaluation, count_at_sites, pooled_report

ExchangeTest = Callable[[Mapping[str, dict[str, Any] | None]], Mapping[str, Mapping[str, Any]]]
"""Sends the test task to the sites named, each with its count request (None: none): site -> answer meta."""


def evaluate_test_split(
    exchange: ExchangeTest,
    announced: Mapping[str, Sequence[str]],
    classes: Sequence[str],
    settings: PooledEvaluation,
    *,
    pool: bool,
    info: Callable[[str], None],
    warning: Callable[[str], None],
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Every site's test metrics and (``pool``) the per-class report pooled from their counts.

    Args:
        exchange: sends the test task (see :data:`ExchangeTest`).
        announced: site -> the classes it labels.
        classes: the global model's classes.
        settings: minimum cell size, bins, tolerance, interval level and threshold.
        pool: count and pool (False: local heads, each site's metrics only).
        info: progress lines.
        warning: a rejected answer, one line naming the site.

    Returns:
        site -> its metrics (the first pass's answers, counts left out), and the pooled report (None
        without ``pool``).
    """
    if not pool:
        answers = exchange(dict.fromkeys(announced))
        return {s: dict(meta.get("metrics") or {}) for s, meta in answers.items()}, None
    evaluated = {s: [c for c in own if c in classes] for s, own in announced.items()}
    passes: list[Mapping[str, Mapping[str, Any]]] = []

    def send(wanted: Mapping[str, list[str]], bins: Mapping[str, BinSpec]) -> Mapping[str, Mapping[str, Any]]:
        got = exchange({s: count_request(v, bins, settings.min_cell) for s, v in wanted.items()})
        passes.append(got)
        return got

    counts = count_at_sites(send, evaluated, settings, info=info, warning=warning)
    metrics = {
        s: {k: v for k, v in (meta.get("metrics") or {}).items() if k != "counts"}
        for s, meta in (passes[0] if passes else {}).items()
    }
    return metrics, pooled_report(classes, evaluated, counts, settings, info)
