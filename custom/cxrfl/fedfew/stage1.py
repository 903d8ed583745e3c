"""Stage 1 on the server: federated SimSiam, FedAvg (weighted by images) of encoder, projector and
predictor, from seeded first weights (the encoder from ``model_config.pretrained`` when given).

The rounds are :meth:`cxrfl.fedfew.rounds.FederatedRounds.run_phase`'s; the result is written to
``stage1_ssl.pt`` (:func:`cxrfl.fedfew.stages.write_stage1`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.common.io import to_numpy
from cxrfl.fedfew import protocol as P
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.plan import ClassPlan
from cxrfl.fedfew.rounds import FederatedRounds, Phase, Progress
from cxrfl.fedfew.ssl import ssl_model
from cxrfl.fedfew.stages import write_stage1
from cxrfl.nn.models import ModelConfig, build_model


def stage1_start(config: FedFewConfig, model_config: ModelConfig, site_config: ModelConfig) -> dict[str, np.ndarray]:
    """Stage 1's first weights: seeded, the encoder from ``model_config.pretrained`` when given.

    Args:
        config: FedFew settings (``seed``, the SimSiam sizes).
        model_config: network settings (``pretrained`` is read here).
        site_config: the same without ``pretrained`` (the sites' network).
    """
    torch.manual_seed(config.seed)
    init = build_model(model_config, 1)  # reads model_config.pretrained, if any
    model = ssl_model(site_config, config)
    model.backbone.load_state_dict(init.backbone.state_dict())
    return to_numpy(model.state_dict())


def run_stage1(
    rounds: FederatedRounds,
    plan: ClassPlan,
    progress: Progress | None,
    *,
    config: FedFewConfig,
    model_config: ModelConfig,
    site_config: ModelConfig,
    meta_for: Callable[[str, int], dict[str, Any]],
    path: Path,
) -> dict[str, np.ndarray] | None:
    """Run (or go on with) stage 1 and write its file.

    Args:
        rounds: the server loop that runs the rounds.
        plan: the class plan (``ssl_sites``).
        progress: stage 1's progress of an interrupted run (None: start).
        config: FedFew settings.
        model_config: network settings.
        site_config: the sites' network settings (``pretrained`` unset).
        meta_for: (site, round) -> the task meta.
        path: stage 1's file.

    Returns:
        The SimSiam weights.
    """
    progress = progress or Progress(1, stage1_start(config, model_config, site_config))
    expected = {k: tuple(v.shape) for k, v in progress.params.items()}
    if config.ssl_rounds == 0:
        rounds.info("stage 1 (self-supervised): ssl_rounds = 0, skipped")
    elif not plan.ssl_sites:
        rounds.warning("stage 1 (self-supervised): no site has images for it; stage 2 starts from the initial weights")
    else:
        if progress.round == 0 and rounds.on_round is not None:
            rounds.on_round(1, 0, progress.params)
        phase = Phase(1, "ssl", P.SSL, config.ssl_rounds, tuple(plan.ssl_sites))
        rounds.run_phase(phase, progress, meta_for, expected)
    written = write_stage1(path, progress.params, site_config, config, progress.contributed)
    rounds.info(f"stage 1 done: {written}")
    return progress.params
