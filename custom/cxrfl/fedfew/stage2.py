"""Stage 2 on the server: energy-based multi-label training over the CCs + "no CC", FedAvg weighted
by labelled images.

Unless both margins are configured, warm-up rounds without the energy term come first (CC sites
only: the UC sites have no other loss) and the margins are chosen from the warm-up model's mean
energies (:func:`cxrfl.fedfew.energy.margins_from_means`). With ``patience`` set, the CC sites
score every new model on their validation split (``fedfew_validate``, ``split: val``): each phase
stops early and keeps its model of lowest validation loss (:class:`cxrfl.common.selection.EarlyStopping`).
The result is written to ``stage2_model.pt`` (:func:`cxrfl.fedfew.stages.write_stage2`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.common.io import to_numpy
from cxrfl.common.server import RunStopped
from cxrfl.fedfew import protocol as P
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.energy import margins_from_means
from cxrfl.fedfew.learner import stage2_classes
from cxrfl.fedfew.plan import ClassPlan
from cxrfl.fedfew.rounds import FederatedRounds, Phase, Progress, Score
from cxrfl.fedfew.ssl import load_encoder
from cxrfl.fedfew.stages import write_stage2
from cxrfl.nn.models import ModelConfig, build_model


def stage2_start(
    config: FedFewConfig, model_config: ModelConfig, plan: ClassPlan, ssl_state: Mapping[str, np.ndarray] | None
) -> dict[str, np.ndarray]:
    """The stage-2 network's first weights: seeded, with stage 1's encoder when there is one.

    Args:
        config: FedFew settings (``seed``).
        model_config: network settings.
        plan: the class plan (the CCs).
        ssl_state: stage 1's SimSiam weights (None: no stage 1).
    """
    torch.manual_seed(config.seed + 1)
    net = build_model(model_config, len(stage2_classes(plan.cc_classes)))
    if ssl_state is not None:
        load_encoder(net, ssl_state)
    return to_numpy(net.state_dict())


def stage2_phases(config: FedFewConfig, plan: ClassPlan, score: Score | None) -> list[Phase]:
    """Warm-up (when the margins must be chosen), then the energy rounds (BCE rounds at the CC sites
    when lambda is 0).

    Without lambda the schedule stays FedFew's (the same phases, round budgets and patience), so that
    the ablation differs from FedFew in the hinge terms only, not in how long it trains.

    Args:
        config: FedFew settings.
        plan: the class plan (who trains in which phase).
        score: a new model's validation loss (None: the phases are not scored).
    """
    common: dict[str, Any] = {"score": score, "patience": config.patience or 1, "min_delta": config.min_delta}
    phases = []
    if not config.margins_given and config.warmup_rounds:
        phases.append(Phase(2, "warm-up", P.TRAIN, config.warmup_rounds, tuple(plan.cc_sites), **common))
    if config.rounds and config.energy_weight > 0:
        phases.append(
            Phase(2, "energy", P.TRAIN, config.rounds, tuple(plan.stage2_sites), config.energy_weight, **common)
        )
    elif config.rounds:  # a UC site has no loss without lambda
        phases.append(Phase(2, "bce", P.TRAIN, config.rounds, tuple(plan.cc_sites), **common))
    return phases


def validation_loss(rounds: FederatedRounds, plan: ClassPlan, meta: P.SiteMeta) -> Score:
    """A new stage-2 model's CC validation loss: the CC sites' BCE on their validation splits, pooled
    over the known labels.

    Args:
        rounds: the server loop that asks the sites.
        plan: the class plan (the CC sites).
        meta: a site's task meta.
    """

    def score(params: Mapping[str, np.ndarray]) -> tuple[float | None, dict[str, Any]]:
        answers = rounds.broadcast(P.VALIDATE, plan.cc_sites, params, lambda s: meta(s, split="val"))
        detail, total, weighted = {}, 0, 0.0
        for site, (_, m_site) in sorted(answers.items()):
            m = m_site.get("metrics") or {}
            try:
                loss, known = m.get("cc_loss"), int(m.get("cc_known") or 0)
                loss = None if loss is None else float(loss)
            except (TypeError, ValueError):
                rounds.warning(
                    f"stage 2: validation answer of site {site} is unusable ({m.get('cc_loss')!r}); left out"
                )
                continue
            detail[site] = {"cc_loss": loss, "cc_known": known, "cc_mean_auroc": m.get("cc_mean_auroc")}
            if loss is not None and known > 0 and math.isfinite(loss):
                total, weighted = total + known, weighted + loss * known
        return (weighted / total if total else None), detail

    return score


def choose_margins(
    rounds: FederatedRounds,
    plan: ClassPlan,
    state: Mapping[str, np.ndarray],
    config: FedFewConfig,
    meta: P.SiteMeta,
) -> dict[str, Any]:
    """The margins from the warm-up model's mean energies at the stage-2 sites (a configured margin is kept).

    Args:
        rounds: the server loop that asks the sites.
        plan: the class plan (the stage-2 sites).
        state: the warm-up model.
        config: FedFew settings (``m_in``, ``m_out``, ``margin_widen``).
        meta: a site's task meta.
    """
    results = rounds.broadcast(P.ENERGY, plan.stage2_sites, state, lambda s: meta(s, mode="means"))
    stats = [m["stats"] for _, m in results.values() if isinstance(m.get("stats"), Mapping)]
    n_in = sum(int(s["n_in"]) for s in stats)
    n_out = sum(int(s["n_out"]) for s in stats)
    if n_in == 0:
        raise RunStopped("stage 2: no site reported energies of CC-labelled images; the margins cannot be chosen")
    mean_in = sum(float(s["sum_in"]) for s in stats) / n_in
    if n_out == 0:
        rounds.warning("stage 2: no site reported UC-positive images; m_out is chosen from the CC energies alone")
        mean_out = mean_in
    else:
        mean_out = sum(float(s["sum_out"]) for s in stats) / n_out
    m_in, m_out = margins_from_means(mean_in, mean_out, config.margin_widen)
    if config.m_in is not None:
        m_in = float(config.m_in)
    if config.m_out is not None:
        m_out = float(config.m_out)
    rounds.info(
        f"stage 2 margins from the warm-up model: mean energy of CC images {mean_in:.4f} (n={n_in}), of UC "
        f"images {mean_out:.4f} (n={n_out}) -> m_in {m_in:.4f}, m_out {m_out:.4f}"
    )
    return {
        "m_in": m_in,
        "m_out": m_out,
        "chosen": "warm-up",
        "mean_in": mean_in,
        "mean_out": mean_out,
        "n_in": n_in,
        "n_out": n_out,
    }


def run_stage2(
    rounds: FederatedRounds,
    plan: ClassPlan,
    ssl_state: Mapping[str, np.ndarray] | None,
    progress: Progress | None,
    *,
    config: FedFewConfig,
    model_config: ModelConfig,
    meta: P.SiteMeta,
    path: Path,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Run (or go on with) stage 2's phases and write its file.

    Args:
        rounds: the server loop that runs the rounds.
        plan: the class plan.
        ssl_state: stage 1's SimSiam weights (None: no stage 1).
        progress: stage 2's progress of an interrupted run (None: start).
        config: FedFew settings.
        model_config: network settings.
        meta: a site's task meta.
        path: stage 2's file.

    Returns:
        The stage-2 weights and the margins.
    """
    if not plan.stage2_sites:
        raise RunStopped("stage 2: no site has labelled training images; nothing to train")
    classes = stage2_classes(plan.cc_classes)
    if progress is None:
        chosen = (
            "config" if config.margins_given else None if config.energy_weight > 0 else "unused (energy_weight = 0)"
        )
        progress = Progress(
            2,
            stage2_start(config, model_config, plan, ssl_state),
            margins={"m_in": config.m_in, "m_out": config.m_out, "chosen": chosen},
        )
    expected = {k: tuple(v.shape) for k, v in progress.params.items()}
    phases = stage2_phases(config, plan, validation_loss(rounds, plan, meta) if config.patience is not None else None)
    result = progress.params
    for i, phase in enumerate(phases):
        if i < progress.phase:
            continue
        if phase.name == "energy" and progress.margins.get("chosen") is None:
            progress.margins = choose_margins(rounds, plan, progress.params, config, meta)

        def meta_for(site: str, rnd: int, w: float = phase.energy_weight) -> dict[str, Any]:
            return meta(
                site, round=rnd, energy_weight=w, m_in=progress.margins["m_in"], m_out=progress.margins["m_out"]
            )

        result = rounds.run_phase(phase, progress, meta_for, expected)
        if i + 1 < len(phases):
            progress.next_phase(result)
    margins = dict(progress.margins)
    if margins.get("chosen") is None:  # rounds == 0: margins never needed
        margins["chosen"] = "unused (no energy round)"
    written = write_stage2(
        path,
        result,
        classes=classes,
        model_config=model_config,
        cc_classes=plan.cc_classes,
        margins=margins,
        rounds=progress.round,
        config=config,
    )
    rounds.info(f"stage 2 done: {written}")
    return dict(result), margins
