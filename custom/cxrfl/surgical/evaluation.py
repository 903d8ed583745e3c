"""The selected surgical model on every site's test split and on the external test set, at the end of a run.

Each site scores the model it is sent (the feature extractor and its own head rows; with local heads its
own head of the selected round) and answers its metrics and, per class it labels, binned counts pooled
per class over the sites that label it (:mod:`cxrfl.clinical.final_evaluation`); the server scores the
global model on the external set itself. The report goes to ``cxrfl/evaluation.json``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from cxrfl.clinical.final_evaluation import evaluate_test_split
from cxrfl.common.server import ServerLoop
from cxrfl.common.transport import Message
from cxrfl.data.site import load_site
from cxrfl.errors import CxrflError
from cxrfl.nn.evaluation import evaluate_on_site, shared_classes
from cxrfl.nn.metrics import summarise_auroc
from cxrfl.nn.models import build_model
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import VALIDATE
from cxrfl.surgical.records import fmt
from cxrfl.surgical.state import RunState

Messages = Callable[..., dict[str, Message]]
"""``(state, params, **meta)`` -> one message per site of the run (:meth:`cxrfl.surgical.tasks.SiteTasks.messages`)."""


def evaluate_final(
    loop: ServerLoop,
    config: SurgicalConfig,
    state: RunState,
    best_round: int,
    best_params: Mapping[str, Any],
    messages: Messages,
) -> dict[str, Any]:
    """The selected model on the sites' test splits (their metrics, and per class pooled from their binned
    counts) and the external set; writes ``cxrfl/evaluation.json``.

    Args:
        loop: the server loop that asks the sites and writes the report.
        config: the run's settings (``evaluate_test``, ``pooled``, ``head_mode``, ``external_test``).
        state: the run (its classes and the sites' announced classes).
        best_round: the selected round.
        best_params: the selected global model.
        messages: builds the sites' messages.
    """
    shared = shared_classes(state.announced)
    report: dict[str, Any] = {
        "classes": state.classes,
        "shared_classes": shared,
        "best_round": best_round,
        "sites": {},
        "external": None,
        "pooled": None,
    }
    if config.evaluate_test:

        def exchange(requests: Mapping[str, dict[str, Any] | None]) -> dict[str, Mapping[str, Any]]:
            payloads = {
                s: (p, m if requests[s] is None else {**m, "counts": requests[s]})
                for s, (p, m) in messages(state, best_params, split="test", model_round=best_round).items()
                if s in requests
            }
            return {s: meta for s, (_, meta) in loop.exchange(VALIDATE, payloads).items()}

        metrics, report["pooled"] = evaluate_test_split(
            exchange,
            state.announced,
            state.classes,
            config.pooled,
            pool=config.head_mode != "local",
            info=loop.info,
            warning=loop.warning,
        )
        for site, m in sorted(metrics.items()):
            own = {c: v for c, v in (m.get("auroc") or {}).items() if c in state.announced.get(site, ())}
            report["sites"][site] = {**m, **summarise_auroc(own, shared=shared)}
    report["external"] = external_evaluation(
        config, state.classes, best_params, shared, info=loop.info, warning=loop.warning
    )
    loop.write_evaluation(report)
    return report


def external_evaluation(
    config: SurgicalConfig,
    classes: list[str],
    params: Mapping[str, Any],
    shared: list[str],
    *,
    info: Callable[[str], None],
    warning: Callable[[str], None],
) -> dict[str, Any] | None:
    """The selected global model on the external test set (None: no external set, local heads without a
    global model, or one that cannot be read: one warning).

    Args:
        config: the run's settings (``external_test``, ``head_mode``, ``model_config``).
        classes: the global head's classes.
        params: the selected global model.
        shared: the classes held by two or more sites.
        info: the operator log.
        warning: the warning log.
    """
    if not config.external_test:
        return None
    if config.head_mode == "local":
        info("personalized FL (local heads) has no global model: the external test set is not evaluated")
        return None
    model_config = config.model_config
    try:
        model = build_model(model_config, len(classes))
        model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in params.items()})
        data = load_site(config.external_test)
        ext = evaluate_on_site(model, classes, data, image_size=model_config.image_size, splits=None)
    except CxrflError as exc:
        warning(f"external test set could not be evaluated: {exc}")
        return None
    ext.update(summarise_auroc(ext["auroc"], shared=shared))
    info(f"external test {data.site}: mean AUROC {fmt(ext['mean'])}")
    return {"site": data.site, **ext}
