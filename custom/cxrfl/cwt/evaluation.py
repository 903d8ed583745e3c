"""The best relay model on every site's test split, at the end of a cyclical-weight-transfer run.

Each site of the relay scores the model and answers its metrics and, per class it labels, binned counts
pooled per class over the sites that label it (:mod:`cxrfl.clinical.final_evaluation`). The report goes
to ``cxrfl/evaluation.json``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cxrfl.clinical.final_evaluation import evaluate_test_split
from cxrfl.clinical.pooling import PooledEvaluation
from cxrfl.common.server import ServerLoop
from cxrfl.cwt.config import RelayConfig
from cxrfl.cwt.relay import VALIDATE_TASK
from cxrfl.cwt.site import pooled_loss
from cxrfl.cwt.state import RelayPlan
from cxrfl.nn.metrics import summarise_auroc

TaskMeta = Callable[..., dict[str, Any]]
"""``(classes, **extra)`` -> a task's meta (the server's settings for the sites, plus ``extra``)."""


def evaluate_final(
    loop: ServerLoop,
    plan: RelayPlan,
    weights: Mapping[str, np.ndarray],
    best_cycle: int,
    *,
    method: str,
    relay: RelayConfig,
    meta: TaskMeta,
) -> dict[str, Any]:
    """The best model's report (with ``relay.evaluate_test``: every site's test metrics, their pooled
    loss and the per-class report); writes ``cxrfl/evaluation.json``.

    Args:
        loop: the server loop that asks the sites and writes the report.
        plan: the relay's plan (its sites, classes and the sites' counts).
        weights: the best model.
        best_cycle: its cycle.
        method: the CWT variant (``config.method``).
        relay: the relay's settings (``evaluate_test``, ``pooled``).
        meta: builds a task's meta.
    """
    report: dict[str, Any] = {
        "classes": plan.classes,
        "method": method,
        "best_cycle": best_cycle,
        "sites": {},
    }
    if relay.evaluate_test:
        metrics, pooled = evaluate_sites(loop, plan, weights, best_cycle, pooled=relay.pooled, meta=meta)
        for s, m in sorted(metrics.items()):
            report["sites"][s] = {**m, "auroc_summary": summarise_auroc(m.get("auroc") or {})}
        report["pooled_loss"] = pooled_loss(
            [(m.get("loss", math.nan), m.get("n_known", 0)) for m in report["sites"].values()]
        )
        report["pooled"] = pooled
    loop.write_evaluation(report)
    return report


def evaluate_sites(
    loop: ServerLoop,
    plan: RelayPlan,
    weights: Mapping[str, np.ndarray],
    cycle: int,
    *,
    pooled: PooledEvaluation,
    meta: TaskMeta,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Every site's test metrics and the per-class report pooled from their binned counts
    (:func:`cxrfl.clinical.final_evaluation.evaluate_test_split`).

    Args:
        loop: the server loop that asks the sites.
        plan: the relay's plan.
        weights: the evaluated model.
        cycle: its cycle.
        pooled: how the test split is counted at the sites and pooled.
        meta: builds a task's meta.
    """

    def exchange(requests: Mapping[str, dict[str, Any] | None]) -> dict[str, Mapping[str, Any]]:
        metas = {s: meta(plan.classes, split="test", cycle=cycle, counts=r) for s, r in requests.items()}
        answers = loop.exchange(VALIDATE_TASK, {s: (dict(weights), m) for s, m in metas.items()})
        loop.check_abort()  # aborted meanwhile: stop at once, nothing written
        return {s: a[1] for s, a in answers.items()}

    # a site labels its own classes (multi-label task), or the one task class
    announced = {s: list(plan.counts.get(s, {}).get("classes") or plan.classes) for s in plan.relay}
    return evaluate_test_split(
        exchange, announced, plan.classes, pooled, pool=True, info=loop.info, warning=loop.warning
    )
