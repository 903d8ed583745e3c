"""The final FedFew model on every stage-2 site's test split, asked for by the server.

Each site reports its CCs' metrics and its UCs' detection (with its own UCs' detectors only); the
CCs are also pooled per class over the sites that label them, from binned counts
(:mod:`cxrfl.clinical.final_evaluation`). The report goes to ``cxrfl/evaluation.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from cxrfl.clinical.final_evaluation import evaluate_test_split
from cxrfl.clinical.pooling import PooledEvaluation
from cxrfl.common.server import ServerLoop
from cxrfl.fedfew import protocol as P
from cxrfl.fedfew.detectors import PAYLOAD_KEYS, Detector
from cxrfl.fedfew.plan import ClassPlan


def evaluate_final(
    loop: ServerLoop,
    plan: ClassPlan,
    state: Mapping[str, np.ndarray],
    stage3: Mapping[str, Any],
    detectors: Mapping[str, list[Detector]],
    *,
    detector: str,
    site_ccs: Mapping[str, list[str]],
    pooled: PooledEvaluation,
    meta: P.SiteMeta,
) -> dict[str, Any]:
    """Every stage-2 site's test metrics (its CCs, its UCs' detection), and the CCs pooled per class.

    Args:
        loop: the server loop that asks the sites and writes the report.
        plan: the class plan.
        state: the final stage-2 weights.
        stage3: stage 3's result (``threshold``).
        detectors: UC -> its detectors.
        detector: the detector kind (``config.detector``).
        site_ccs: site -> the CCs it labels (from its info).
        pooled: the pooling settings.
        meta: a site's task meta.
    """
    key = PAYLOAD_KEYS[detector]

    def meta_for(s: str, counts: Mapping[str, Any] | None = None) -> dict[str, Any]:
        own = [d.to_payload() for uc in plan.site_ucs.get(s, []) for d in detectors.get(uc, [])]
        extra = {key: own, "counts": counts} if counts is not None else {key: own}  # own UCs' detectors only
        return meta(s, threshold=stage3["threshold"], split="test", **extra)

    def exchange(requests: Mapping[str, dict[str, Any] | None]) -> dict[str, Mapping[str, Any]]:
        answers = loop.broadcast(P.VALIDATE, list(requests), state, lambda s: meta_for(s, requests[s]))
        return {s: m for s, (_, m) in answers.items()}

    announced = {s: site_ccs.get(s, []) for s in plan.stage2_sites if site_ccs.get(s)}
    metrics, pooled_report = evaluate_test_split(
        exchange, announced, plan.cc_classes, pooled, pool=True, info=loop.info, warning=loop.warning
    )
    uc_only = [s for s in plan.stage2_sites if s not in announced]
    metrics.update({s: dict(m.get("metrics") or {}) for s, m in exchange(dict.fromkeys(uc_only)).items()})
    report: dict[str, Any] = {
        "cc_classes": plan.cc_classes,
        "uc_classes": plan.uc_classes,
        "threshold": stage3["threshold"],
        "detector": detector,
        "sites": {},
        "pooled": pooled_report,
    }
    for s, ev in sorted(metrics.items()):
        report["sites"][s] = ev
        parts = []
        if ev.get("cc_mean_auroc") is not None:
            parts.append(f"CC mean AUROC {ev['cc_mean_auroc']:.4f}")
        parts += [P.describe_uc(uc, um) for uc, um in (ev.get("uc") or {}).items()]
        loop.info(f"test split of site {s}: {'; '.join(parts) or 'nothing to evaluate'}")
    loop.write_evaluation(report)
    return report
