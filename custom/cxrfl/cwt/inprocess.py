"""Cyclical weight transfer in one process (plain PyTorch; the benchmark's engine)."""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cxrfl.cwt.config import CWTConfig
from cxrfl.cwt.relay import Visit, relay_order, relay_plan
from cxrfl.cwt.site import CWTSite, pooled_loss
from cxrfl.nn.models import ModelConfig, build_model
from cxrfl.nn.training import adam

log = logging.getLogger(__name__)

@dataclass
class CWTResult:
    """Outcome of :func:`run_cwt`.

    Args:
        model: the network with the best cycle's weights.
        classes: its outputs.
        best_cycle: the cycle with the lowest pooled validation loss (0: no cycle had a finite
            loss; the model is then the initial one).
        best_val_loss: that loss.
        plan: site -> (steps, lr) per visit.
        history: one record per cycle (order, visits, pooled validation loss).
        stopped_early: early stopping ended the run.
        seconds: wall time.
    """

    model: nn.Module
    classes: list[str]
    best_cycle: int
    best_val_loss: float
    plan: dict[str, Visit]
    history: list[dict[str, Any]] = field(default_factory=list)
    stopped_early: bool = False
    seconds: float = 0.0


def run_cwt(
    sites: Sequence[CWTSite],
    model_config: ModelConfig,
    config: CWTConfig,
    *,
    device: torch.device | None = None,
    available: Callable[[str, int], bool] | None = None,
    logger: logging.Logger | None = None,
) -> CWTResult:
    """Cyclical weight transfer in one process (plain PyTorch; the benchmark's engine).

    Every cycle the model visits the sites in :func:`relay_order`; each trains it in place for
    its :func:`relay_plan` steps at its rate; after the cycle the pooled validation loss over all
    sites decides early stopping, and the best cycle's weights are kept (the untrained initial
    model is never chosen, as NVFlare's model selectors skip round 0). Central hosting is
    ``run_cwt`` over one site holding all the data.

    Args:
        sites: the sites (same ``classes``), in fixed relay order.
        model_config: the network.
        config: the run's settings (``sites`` must have been built with the same).
        device: torch device (default: the sites').
        available: ``(site, cycle) -> bool``; a site that is not available is skipped for that
            turn (with a log line) and the model goes on to the next site unchanged.
        logger: where to log (default: this module's logger).
    """
    logger = logger or log
    start = time.perf_counter()
    if not sites:
        raise ValueError("run_cwt needs at least one site")
    classes = sites[0].classes
    if any(s.classes != classes for s in sites):
        raise ValueError("all sites must be built with the same classes (see make_sites)")
    device = device or sites[0].device
    for s in sites:
        for w in s.warnings:
            logger.warning(w)
    plan = relay_plan({s.name: s.num_train for s in sites}, config)
    relay = [s for s in sites if s.name in plan]
    torch.manual_seed(config.seed)
    model = build_model(model_config, len(classes)).to(device)
    optimizer = adam(model, config.lr, config.weight_decay)

    def val_loss() -> float:
        return pooled_loss([(r.loss, float(r.mask.sum())) for r in (s.evaluate(model, "val") for s in relay)])

    best_loss, best_cycle = math.inf, 0
    best_state = copy.deepcopy(model.state_dict())
    history: list[dict[str, Any]] = []
    stale, stopped = 0, False
    by_name = {s.name: s for s in relay}
    for cycle in range(1, config.num_cycles + 1):
        order = relay_order([s.name for s in relay], cycle, config.order, config.seed)
        visits = []
        for name in order:
            if available is not None and not available(name, cycle):
                logger.warning("cycle %d: site %s is not available; skipped, the model goes on unchanged", cycle, name)
                visits.append({"site": name, "cycle": cycle, "skipped": True})
                continue
            if config.optimizer_state == "reset":
                optimizer = adam(model, config.lr, config.weight_decay)
            visits.append(by_name[name].train_visit(model, optimizer, plan[name], cycle))
        loss = val_loss()
        history.append({"cycle": cycle, "order": order, "visits": visits, "val_loss": loss})
        logger.info("cycle %d (%s): pooled val loss %.4f", cycle, " > ".join(order), loss)
        if math.isfinite(loss) and (best_cycle == 0 or loss < best_loss - config.min_delta):
            best_loss, best_cycle, stale = loss, cycle, 0
            best_state = copy.deepcopy(model.state_dict())
        else:
            stale += 1
            if stale >= config.patience:
                stopped = True
                logger.info("early stop after cycle %d (best cycle %d)", cycle, best_cycle)
                break
    model.load_state_dict(best_state)
    return CWTResult(model=model, classes=list(classes), best_cycle=best_cycle, best_val_loss=best_loss, plan=plan,
                     history=history, stopped_early=stopped, seconds=time.perf_counter() - start)
