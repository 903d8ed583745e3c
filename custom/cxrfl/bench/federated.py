"""In-process federated training: the NVFlare workflow's loop without NVFlare.

:func:`run_federated` does what :class:`cxrfl.fl.controller.SurgicalAggregation` and the site
executors do in a job (head warm-up, rounds, the sites' own training code, aggregation by
:mod:`cxrfl.surgical.head_modes`, model selection on the mean of the sites' validation BCE with
patience), in one process. With one site it is local training (the individually trained and
centralized baselines): aggregating a single update returns it unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.data.site import SiteData
from cxrfl.surgical.head_modes import aggregate, payload_for
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, batchnorm_keys, build_model
from cxrfl.common.io import to_numpy
from cxrfl.surgical.learner import SiteLearner
from cxrfl.nn.training import TrainConfig

Log = Callable[[str], None]


def initial_state(model_config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """The initial feature extractor (BatchNorm statistics included), as the controller builds it.

    Args:
        model_config: network settings.
        seed: torch seed of the initial weights.
    """
    torch.manual_seed(seed)
    init = build_model(model_config, 1)
    return {k: v for k, v in to_numpy(init.state_dict()).items() if not k.startswith(HEAD_PREFIX)}


def nbytes(params: Mapping[str, Any]) -> int:
    """Bytes of the arrays in a parameter dict (what travels, before serialisation overhead)."""
    return int(sum(np.asarray(v).nbytes for v in params.values()))


@dataclass
class FedResult:
    """A finished run.

    Args:
        classes: the global head's classes ([] for local heads).
        global_state: best global parameters (feature extractor, and head unless local).
        site_states: local heads: site -> full state of the site's own model at the best round.
        site_classes: site -> its own classes.
        best_round: the round whose model was selected (0: the warmed-up model).
        val_loss: mean validation BCE of the sites, per evaluated round (index = model round).
        site_val_loss: site -> validation BCE per evaluated round.
        comm: site -> bytes received and sent in the last round.
        seconds: wall time.
        rounds: rounds trained.
        images_per_second: mean local training throughput over sites and rounds.
    """

    classes: list[str]
    global_state: dict[str, np.ndarray]
    site_states: dict[str, dict[str, torch.Tensor]] | None
    site_classes: dict[str, list[str]]
    best_round: int
    val_loss: list[float]
    site_val_loss: dict[str, list[float]]
    comm: dict[str, dict[str, int]]
    seconds: float
    rounds: int
    images_per_second: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class WarmStart:
    """A cached head warm-up of one site: what its learner sent (feature extractor + own rows)."""

    params: dict[str, np.ndarray]
    classes: list[str]
    val_loss: float


def warm_up(
    data: SiteData,
    init: dict[str, np.ndarray],
    *,
    model_config: ModelConfig,
    train_config: TrainConfig,
    state_dir: Path,
) -> WarmStart:
    """Head warm-up of one site (feature extractor frozen); the same in every head mode.

    Args:
        data: the site.
        init: the initial feature extractor.
        model_config: network settings.
        train_config: optimisation settings.
        state_dir: the learner's state folder.
    """
    learner = SiteLearner(data, state_dir, model_config=model_config, train_config=train_config)
    update = learner.warmup(init)
    return WarmStart(update.params, update.classes, float(update.metrics["val_loss"]))


def _mean_loss(losses: list[float]) -> float:
    finite = [v for v in losses if v is not None and np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def run_federated(
    sites: list[SiteData],
    *,
    head_mode: str,
    missing: str,
    batchnorm: str,
    model_config: ModelConfig,
    train_config: TrainConfig,
    rounds: int,
    init: dict[str, np.ndarray],
    workdir: Path,
    warm: Mapping[str, WarmStart] | None = None,
    patience: int = 5,
    min_delta: float = 1e-4,
    log: Log | None = None,
    label: str = "",
    max_steps: Mapping[str, int] | None = None,
) -> FedResult:
    """Train like the NVFlare job does, in this process.

    Args:
        sites: the training sites (one site: local training).
        head_mode: ``surgical``, ``union`` or ``local``.
        missing: ``negative`` or ``ignore`` (union heads).
        batchnorm: ``fedavg``, ``fedbn`` or ``fedbn+``.
        model_config: network settings.
        train_config: site training settings (its seed seeds every site).
        rounds: federated rounds after the warm-up (= local epochs for one site).
        init: the initial feature extractor (:func:`initial_state`).
        workdir: folder for the sites' state.
        warm: cached warm-ups by site (skips those sites' warm-up; must come from the same
            init, data and settings).
        patience: rounds without improvement of the mean validation loss before stopping.
        min_delta: smaller improvements do not count.
        log: progress callback (one line per round).
        label: name in progress lines.
        max_steps: per-site cap on steps per local epoch (overrides the train config's).
    """
    start = time.perf_counter()
    say = log or (lambda _msg: None)
    learners: dict[str, SiteLearner] = {}
    for data in sites:
        tc = train_config
        if max_steps and data.site in max_steps:
            tc = replace(tc, max_steps_per_epoch=max_steps[data.site])
        learners[data.site] = SiteLearner(
            data, workdir / data.site, model_config=model_config, train_config=tc, batchnorm=batchnorm,
            head_mode=head_mode, missing=missing,
        )
    bn_keys = set(batchnorm_keys(next(iter(learners.values())).model))
    exclude = bn_keys if batchnorm == "fedbn" else set()
    agg_args = {"batchnorm": batchnorm, "bn_keys": sorted(bn_keys)}

    # ---- head warm-up (own classes, feature extractor frozen)
    updates = []
    for name, learner in learners.items():
        if warm is not None and name in warm:
            learner.load_params(warm[name].params, restore_local=False)
            params = learner.outgoing_params()
        else:
            params = learner.warmup(init).params
        updates.append({"site": name, "classes": learner.own_classes, "params": params, "num_samples": learner.num_train})
    # warm-up results carry each site's own rows: stitched surgically in every mode but local
    agg, classes = aggregate(updates, head_mode="local" if head_mode == "local" else "surgical", **agg_args)
    global_state = {**init, **agg}
    site_classes = {name: list(learner.own_classes) for name, learner in learners.items()}
    say(f"{label} warm-up done ({time.perf_counter() - start:.1f}s)")

    best_loss, best_round, best_state, best_sites, stale = float("inf"), 0, dict(global_state), None, 0
    history: list[float] = []
    site_history: dict[str, list[float]] = {name: [] for name in learners}
    comm: dict[str, dict[str, int]] = {}
    speeds: list[float] = []
    rnd = 0

    def received_states(payloads: dict[str, tuple[dict, list[str] | None]]) -> dict[str, dict[str, torch.Tensor]] | None:
        """Local heads: each site's full model as evaluated (received feature extractor + own head)."""
        if head_mode != "local":
            return None
        out = {}
        for name, (params, sent) in payloads.items():
            learner = learners[name]
            learner.load_params(params)
            out[name] = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
        return out

    def consider(losses: dict[str, float], evaluated: dict[str, np.ndarray], states, model_round: int) -> bool:
        """Model selection as the controller does it; returns True to stop early."""
        nonlocal best_loss, best_round, best_state, best_sites, stale
        mean = _mean_loss(list(losses.values()))
        history.append(mean)
        for name, v in losses.items():
            site_history[name].append(v)
        if np.isfinite(mean) and mean < best_loss - min_delta:
            best_loss, best_round, best_state, best_sites, stale = mean, model_round, evaluated, states, 0
            return False
        stale += 1
        return stale >= patience

    stopped = False
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        payloads = {
            name: payload_for(global_state, classes, learner.own_classes, head_mode=head_mode, exclude=exclude)
            for name, learner in learners.items()
        }
        evaluated = dict(global_state)
        states = received_states(payloads)
        updates, losses = [], {}
        for name, learner in learners.items():
            params, sent = payloads[name]
            upd = learner.train_round(params, rnd, classes=sent)
            losses[name] = upd.metrics["val_loss"]
            speeds.append(upd.metrics["images_per_second"])
            comm[name] = {"down": nbytes(params), "up": nbytes(upd.params)}
            updates.append({"site": name, "classes": upd.classes, "params": upd.params, "num_samples": upd.num_samples})
        reference = None if head_mode == "local" else evaluated
        agg, _ = aggregate(updates, head_mode=head_mode, classes=None if head_mode == "local" else classes,
                           reference=reference, **agg_args)
        global_state.update(agg)
        stop = consider(losses, evaluated, states, rnd - 1)
        say(f"{label} round {rnd}/{rounds}: mean val loss of round-{rnd - 1} model {history[-1]:.4f} "
            f"(best round {best_round}) {time.perf_counter() - t0:.1f}s")
        if stop:
            say(f"{label} early stop after round {rnd} (no improvement for {patience} rounds)")
            stopped = True
            break
    if not stopped and rounds > 0:
        # the last aggregated model is evaluated too (the NVFlare job would need another round for it)
        payloads = {
            name: payload_for(global_state, classes, learner.own_classes, head_mode=head_mode, exclude=exclude)
            for name, learner in learners.items()
        }
        losses = {name: learners[name].evaluate_params(p, "val", classes=sent)["loss"] for name, (p, sent) in payloads.items()}
        consider(losses, dict(global_state), received_states(payloads), rnd)
    if rounds == 0:
        payloads = {
            name: payload_for(global_state, classes, learner.own_classes, head_mode=head_mode, exclude=exclude)
            for name, learner in learners.items()
        }
        losses = {name: learners[name].evaluate_params(p, "val", classes=sent)["loss"] for name, (p, sent) in payloads.items()}
        consider(losses, dict(global_state), received_states(payloads), 0)
    return FedResult(
        classes=list(classes),
        global_state=best_state,
        site_states=best_sites,
        site_classes=site_classes,
        best_round=best_round,
        val_loss=history,
        site_val_loss=site_history,
        comm=comm,
        seconds=time.perf_counter() - start,
        rounds=rnd,
        images_per_second=float(np.mean(speeds)) if speeds else 0.0,
    )


def global_model(result: FedResult, model_config: ModelConfig, init: dict[str, np.ndarray]) -> torch.nn.Module:
    """The selected global model (BatchNorm not averaged under FedBN+: the initial statistics).

    Args:
        result: a run with a global head.
        model_config: network settings.
        init: the initial feature extractor.
    """
    if not result.classes:
        raise ValueError("local heads have no global model")
    model = build_model(model_config, len(result.classes))
    state = model.state_dict()
    for k, v in {**init, **result.global_state}.items():
        state[k] = torch.as_tensor(np.asarray(v)).to(state[k].dtype)
    model.load_state_dict(state)
    return model.eval()


def site_models(result: FedResult, model_config: ModelConfig) -> dict[str, torch.nn.Module]:
    """Local heads: each site's own model at the selected round.

    Args:
        result: a run with local heads.
        model_config: network settings.
    """
    if result.site_states is None:
        raise ValueError("the run has a global head, not local ones")
    out = {}
    for name, state in result.site_states.items():
        model = build_model(model_config, len(result.site_classes[name]))
        model.load_state_dict(state)
        out[name] = model.eval()
    return out
