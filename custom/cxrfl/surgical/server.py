"""The server of surgical aggregation and its baselines, over any transport.

:class:`SurgicalServer` talks to the sites only through ``send`` (:mod:`cxrfl.common.transport`); the
NVFlare workflow (:class:`cxrfl.fl.surgical.SurgicalAggregation`), the benchmarks and the tests
(:mod:`cxrfl.surgical.inprocess`) run this same loop. Sites answer with :class:`cxrfl.surgical.host.SurgicalSiteHost`.

1. Head warm-up (round 0): every site trains the head rows of its own classes on the initial feature
   extractor and announces its classes with them; the rows are stitched into the global head. A site
   without a valid warm-up gets it again in every round's exchange and joins after the round in which
   it answers (:mod:`cxrfl.surgical.join`; a ``join`` record; model selection starts again).
2. Federated rounds: each site receives the feature extractor and only the head rows of its own
   classes (never a name of another site's classes), evaluates the received model on its validation
   split, trains and answers; results are validated (one rejection line each) and aggregated by
   :class:`cxrfl.surgical.round_aggregator.RoundAggregator`. The baselines differ only in ``head_mode``.
3. Model selection (:class:`cxrfl.common.selection.EarlyStopping`): the model of round r is scored in
   round r + 1 by the mean of the sites' validation BCE; the lowest is selected; the run stops after
   ``patience`` rounds without an improvement of ``min_delta``. A run that does not stop early scores
   its last model with a ``validate`` task. With a ``time_budget`` no round starts that would end after
   it (at the pace of the slowest round so far).
4. Evaluation of the selected model on every site's test split (local heads: each site's own head of
   the selected round) and on an external test set (:mod:`cxrfl.surgical.evaluation`).

Faults: a round with fewer than ``min_clients`` valid results (failed, timed out or malformed; or an
aggregation error) keeps the previous global model and is run again after ``retry_pause`` seconds,
until ``min_clients_timeout`` seconds pass without a completed round: then :class:`RunStopped` says
why. After the warm-up and every completed round the state to go on from is saved
(:class:`cxrfl.common.resume.ResumeStore`, linking the checkpoints below); ``resume_from`` continues
from the last completed round (mismatched settings are refused). An abort (:class:`RunAborted`)
writes nothing more.

Written under ``out_dir`` (the server's app folder in a job): ``FL_global_model.pt`` (the latest
global model, one model-sized write per round), ``best_FL_global_model.pt`` (the selected one),
``cxrfl/rounds.jsonl`` (one record per warm-up, round attempt, join, time-budget stop and final
validation: sites, contributors per class, rejections, per-site metrics, mean validation loss and
AUROC), ``cxrfl/checkpoints/round_NNN.pt`` when kept (hard links), ``cxrfl/evaluation.json`` and
``cxrfl/run_config.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.common.io import link_or_copy, to_numpy
from cxrfl.common.selection import EarlyStopping
from cxrfl.common.server import BEST_MODEL, CHECKPOINTS, GLOBAL_MODEL, RECORDS_DIR, RetryClock, ServerLoop, TimeBudget
from cxrfl.common.transport import Message, Send
from cxrfl.errors import CxrflError
from cxrfl.nn.evaluation import shared_classes
from cxrfl.nn.models import HEAD_PREFIX, batchnorm_keys, build_model, save_checkpoint
from cxrfl.surgical.config import RESUME_KEYS, SurgicalConfig
from cxrfl.surgical.evaluation import evaluate_final
from cxrfl.surgical.head_modes import drop_head
from cxrfl.surgical.host import TRAIN, VALIDATE
from cxrfl.surgical.join import add_classes, waiting_sites
from cxrfl.surgical.records import curve_point, fmt, round_record
from cxrfl.surgical.round_aggregator import RoundAggregator, RoundResult
from cxrfl.surgical.state import RunState
from cxrfl.surgical.tasks import SiteTasks


@dataclass
class SurgicalOutcome:
    """A finished run (also in the files under ``out_dir``).

    Args:
        classes: the global head's classes ([] for ``local`` heads).
        site_classes: site -> its own classes (the sites of the run).
        best_round: the round whose model was selected (0: the warmed-up model).
        best_params: the selected global model.
        last_round: the last completed round.
        stopped_early: the run stopped on ``patience``.
        curve: the scored models in round order (learning curves).
        evaluation: what ``cxrfl/evaluation.json`` holds.
    """

    classes: list[str]
    site_classes: dict[str, list[str]]
    best_round: int
    best_params: dict[str, np.ndarray]
    last_round: int
    stopped_early: bool
    curve: list[dict[str, Any]]
    evaluation: dict[str, Any]


class SurgicalServer(ServerLoop):
    """The surgical-aggregation workflow (see the module docstring).

    Args:
        send: the transport.
        config: the run's settings (``resume_from`` among them).
        aggregator_factory: builds the run's round aggregator from what the job decides (``batchnorm``,
            ``bn_keys``, ``head_mode``, ``max_num_samples``, ``warning``) with a policy of its own (a job's
            aggregator component: :meth:`cxrfl.fl.aggregator.SurgicalAggregator.bind`); None: a
            :class:`RoundAggregator` of the config's ``weighting``, ``robust`` and ``clip_norm``.
        kwargs: :class:`cxrfl.common.server.ServerLoop` arguments (sites, out_dir, run_id,
            resume_root, info, warning, aborted).
    """

    def __init__(
        self,
        send: Send,
        *,
        config: SurgicalConfig,
        aggregator_factory: Callable[..., RoundAggregator] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(send, resume_from=config.resume_from, **kwargs)
        self.config = config
        self.aggregator_factory = aggregator_factory
        self.clock = RetryClock(config.min_clients_timeout, config.retry_pause)
        self.state: RunState | None = None
        self.init_params: dict[str, np.ndarray] = {}
        self.bn_keys: set[str] = set()
        self.aggregator: RoundAggregator | None = None
        self.tasks: SiteTasks | None = None
        self.expected: dict[str, tuple[int, ...]] = {}
        self.budget = TimeBudget(config.time_budget)

    # ------------------------------------------------------------------ run
    def run(self) -> SurgicalOutcome:
        """Warm up (or resume), run the rounds, select, evaluate.

        Raises:
            RunStopped: the run cannot go on (the message says why and what to do).
            RunAborted: told to stop; nothing more is written.
        """
        cfg = self.config
        self.info(
            f"surgical aggregation: up to {cfg.num_rounds} rounds, batchnorm={cfg.batchnorm}, "
            f"head_mode={cfg.head_mode}, missing={cfg.missing}, {len(self.sites)} site(s)"
        )
        if cfg.rate_warning():
            self.warning(cfg.rate_warning())
        self.write_run_config(cfg.to_dict())
        self.budget.start()
        self._prepare()
        state = self.state = self._resume() if self.resume_from else self._warmup()
        shared = shared_classes(state.announced)
        self.info(f"global classes: {len(state.classes)} ({len(shared)} shared by 2+ sites)")
        stopped = self._rounds(state)
        if not stopped:
            self._validate_last(state)
        best_round, best_params = self._selected(state)
        self.info(
            f"global model: {self.path(GLOBAL_MODEL)}; selected model (round {best_round}): {self.path(BEST_MODEL)}"
        )
        evaluation = evaluate_final(self, cfg, state, best_round, best_params, self.tasks.messages)
        self.resume.clear()  # finished: nothing to resume
        return SurgicalOutcome(
            list(state.classes),
            {s: list(c) for s, c in state.announced.items()},
            best_round,
            best_params,
            state.round,
            stopped,
            list(state.curve),
            evaluation,
        )

    def _prepare(self) -> None:
        """The initial feature extractor (seeded), BatchNorm keys, task messages, expected shapes, the aggregator."""
        cfg = self.config
        torch.manual_seed(cfg.seed)
        init = build_model(cfg.model_config, 1)
        self.bn_keys = set(batchnorm_keys(init))
        self.tasks = SiteTasks(cfg, self.bn_keys)
        self.init_params = {k: v for k, v in to_numpy(init.state_dict()).items() if not k.startswith(HEAD_PREFIX)}
        local_bn = cfg.batchnorm != "fedavg"
        self.expected = {k: tuple(v.shape) for k, v in self.init_params.items() if not (local_bn and k in self.bn_keys)}
        job = {
            "batchnorm": cfg.batchnorm,
            "bn_keys": sorted(self.bn_keys),
            "head_mode": cfg.head_mode,
            "max_num_samples": cfg.max_num_samples,
            "warning": self.warning,
        }
        if self.aggregator_factory is not None:  # a job's aggregator component, which holds the policy
            self.aggregator = self.aggregator_factory(**job)
        else:
            self.aggregator = RoundAggregator(
                weighting=cfg.weighting, robust=cfg.robust, clip_norm=cfg.clip_norm, **job
            )

    # ---------------------------------------------------------- warm-up
    def _warmup(self) -> RunState:
        """Round 0: the sites' head warm-ups, stitched; the sites that answered make the run."""
        start = time.perf_counter()
        meta = self.tasks.task_meta(self.run_id, phase="warmup", round=0)
        # answers stream into the aggregator, as in the rounds; the initial feature extractor is the
        # reference (dtypes; robust modes bound each update from it, head rows from the zero row)
        self.aggregator.expect(self.expected, reference=self.init_params)
        answers = self.exchange(TRAIN, {s: (dict(self.init_params), meta) for s in self.sites}, on_answer=self._accept)
        self.check_abort()
        result, rejected = self._finish()
        record = {
            **round_record(0, "warmup", self.sites, answers, result, rejected),
            "seconds": time.perf_counter() - start,
        }
        self.record(record)
        if result is None:
            reason = (
                f"stopping: the head warm-up produced fewer than min_clients={self.config.min_clients} valid "
                f"results (answered {record['sites_answered']}, failed {record['sites_failed']}, rejected "
                f"{rejected}); see the sites' logs"
            )
            self.stop(reason, {"round": 0, "phase": "stopped"})
        announced = {s: list(answers[s][1]["classes"]) for s in result.sites}
        state = RunState(
            0,
            {**self.init_params, **result.params},
            list(result.classes),
            announced,
            EarlyStopping(self.config.patience, self.config.min_delta),
            None,
            [],
            self.run_id,
        )
        self._save_model(GLOBAL_MODEL, state.params, state.classes, round=0)
        self._keep(state)
        self.info(
            f"warm-up: {len(announced)} of {len(self.sites)} site(s) announced their classes "
            f"({time.perf_counter() - start:.1f}s)"
        )
        return state

    def _resume(self) -> RunState:
        """The interrupted run's state (refused with the reason when unusable)."""
        state = RunState.from_dict(self.load_resume(self.config.to_dict(), RESUME_KEYS))
        self.record(
            {"round": state.round, "phase": "resumed", "resumed_from": self.resume_from, "run_key": state.run_key}
        )
        self.info(f"resumed {self.resume_from} after its round {state.round}: continuing with round {state.round + 1}")
        self._save_model(GLOBAL_MODEL, state.params, state.classes, round=state.round)
        if state.best_params is not None:
            self._save_model(
                BEST_MODEL,
                state.best_params,
                state.classes,
                round=state.stopper.best_step,
                mean_val_loss=state.stopper.best,
            )
        return state

    def _join(self, state: RunState, rnd: int, waiting: Sequence[str], answers: Mapping[str, Message]) -> None:
        """After round ``rnd``: the sites in ``waiting`` got the head warm-up in its exchange; those
        with a valid answer join (see :mod:`cxrfl.surgical.join`); one ``join`` record."""
        if not waiting:
            return
        reference = drop_head(state.params)  # dtypes; robust modes: new rows bounded from the zero row
        result, rejected = self._aggregate(answers, None, None, reference, minimum=1) if answers else (None, {})
        joined = {s: list(answers[s][1]["classes"]) for s in result.sites} if result else {}
        added: list[str] = []
        if joined:
            if self.config.head_mode != "local":
                state.params, state.classes, added = add_classes(
                    state.params, state.classes, result.params, result.classes
                )
            state.announced.update(joined)
            state.joined.update({s: rnd for s in joined})
            state.stopper, state.best_params = EarlyStopping(self.config.patience, self.config.min_delta), None
            self._save_model(GLOBAL_MODEL, state.params, state.classes, round=state.round)
            self._keep(state)
            self.info(
                f"round {rnd}: site(s) {sorted(joined)} joined late with their warm-up; {len(added)} new class(es) "
                f"in the global head (now {len(state.classes)}); model selection starts again"
            )
        self.record(
            {
                "round": rnd,
                "phase": "join",
                "sites_asked": list(waiting),
                "sites_answered": sorted(answers),
                "sites_failed": sorted(set(waiting) - set(answers)),
                "joined": sorted(joined),
                "new_classes": added,
                "rejected": rejected,
            }
        )

    # ----------------------------------------------------------- rounds
    def _rounds(self, state: RunState) -> bool:
        """Rounds until ``num_rounds`` or early stopping (True); a failed round is run again."""
        rnd = state.round + 1
        while rnd <= self.config.num_rounds and not state.stopper.should_stop:
            if self._out_of_time(rnd):
                break
            waiting, joins = waiting_sites(self.sites, state.announced), {}
            record = self._round(state, rnd, waiting, joins)
            self._join(state, rnd, waiting, joins)
            if not record["aggregated"]:
                self._retry_or_stop(rnd, record)
                continue
            self.clock.succeeded()
            rnd += 1
        if state.stopper.should_stop:
            self.info(
                f"early stop: no improvement of at least min_delta={self.config.min_delta:g} for "
                f"{state.stopper.stale} rounds (selected round {state.stopper.best_step})"
            )
            return True
        return False

    def _out_of_time(self, rnd: int) -> bool:
        """Whether round ``rnd`` would end after ``time_budget`` (logged and recorded once, when it does)."""
        budget, elapsed = self.budget.seconds, self.budget.overrun()
        if elapsed is None:
            return False
        line = (
            f"time budget: round {rnd} would end after time_budget={budget:g}s ({elapsed:.0f}s spent, the slowest "
            f"round took {self.budget.slowest:.0f}s); no more rounds, the last model is scored and the best selected"
        )
        self.info(line)
        self.record({"round": rnd, "phase": "time_budget", "time_budget": budget, "seconds": elapsed, "reason": line})
        return True

    def _round(
        self, state: RunState, rnd: int, waiting: Sequence[str] = (), joins: dict[str, Message] | None = None
    ) -> dict[str, Any]:
        """One attempt at round ``rnd``; returns its record (``aggregated``: it completed). The sites
        in ``waiting`` get the head warm-up on the same feature extractor in the same exchange; their
        answers go to ``joins``."""
        start = time.perf_counter()
        evaluated = dict(state.params)
        announced = {s: state.classes for s in state.announced} if self.config.head_mode == "union" else state.announced
        self.aggregator.expect(self.expected, announced, state.classes, evaluated)
        payloads = self.tasks.messages(state, evaluated, phase="train", round=rnd)
        warmup = self.tasks.task_meta(state.run_key, phase="warmup", round=rnd)
        payloads.update({s: (drop_head(evaluated), dict(warmup)) for s in waiting})

        def on_answer(site: str, answer: Message) -> None:  # into the aggregator as it arrives (params then dropped)
            if site in waiting:
                joins[site] = answer
            else:
                self._accept(site, answer)

        answers = self.exchange(TRAIN, payloads, on_answer=on_answer)
        answers = {s: a for s, a in answers.items() if s not in waiting}
        self.check_abort()  # aborted mid-round: the round is not recorded, nothing is written
        result, rejected = self._finish()
        point = curve_point(rnd - 1, answers, "val_loss", "val_mean_auroc")
        record = {
            **round_record(rnd, "train", list(state.announced), answers, result, rejected),
            "evaluated_round": rnd - 1,
            "mean_val_loss": point["mean_val_loss"],
            "mean_val_auroc": point["mean_val_auroc"],
        }
        if result is not None:
            state.params.update(result.params)
            state.round = rnd
            self._save_model(GLOBAL_MODEL, state.params, state.classes, round=rnd)
            if self.config.keep_round_checkpoints:  # the same file under a second name: no second write
                link_or_copy(self.path(GLOBAL_MODEL), self.path(f"{RECORDS_DIR}/{CHECKPOINTS}/round_{rnd:03d}.pt"))
            self._consider(state, point, evaluated)
            self._keep(state)
            self.info(
                f"round {rnd}: {len(result.sites)} of {len(state.announced)} site(s) aggregated; model of round "
                f"{rnd - 1}: mean val loss {fmt(point['mean_val_loss'])}, mean val AUROC "
                f"{fmt(point['mean_val_auroc'])}; selected round {state.stopper.best_step} "
                f"({time.perf_counter() - start:.1f}s)"
            )
        record["seconds"] = time.perf_counter() - start
        if result is not None:
            self.budget.took(record["seconds"])
        self.record(record)  # after the resume state: a recorded round is a round a resumed run does not redo
        return record

    def _retry_or_stop(self, rnd: int, record: Mapping[str, Any]) -> None:
        """After a failed attempt: wait and try again, or stop once ``min_clients_timeout`` is spent."""
        self.retry_or_stop(
            f"round {rnd} had fewer than min_clients={self.config.min_clients} valid site results (answered "
            f"{record['sites_answered']}, failed {record['sites_failed']}, rejected {record['rejected']})",
            setting="min_clients_timeout",
            kept=f"the last completed round ({rnd - 1}) is in {self.path(GLOBAL_MODEL)}; resume with "
            f"resume_from={self.run_id!r} once enough sites are back",
            step={"round": rnd, "phase": "stopped"},  # phase: how surgical records were told apart before
        )

    def _aggregate(
        self,
        answers: Mapping[str, Message],
        announced: Mapping[str, Sequence[str]] | None,
        classes: Sequence[str] | None,
        reference: Mapping[str, Any] | None,
        minimum: int | None = None,
    ) -> tuple[RoundResult | None, dict[str, str]]:
        """Validate and aggregate the answers; None when fewer than ``minimum`` (default
        ``min_clients``) are valid or the aggregation fails (an overflow, ...: a failed round, never a crash)."""
        self.aggregator.expect(self.expected, announced, classes, reference)
        for site, answer in sorted(answers.items()):
            self._accept(site, answer)
        return self._finish(minimum)

    def _accept(self, site: str, answer: Message) -> None:
        """Hand one site's answer to the aggregator (validated; a rejection is one warning line)."""
        params, meta = answer
        self.aggregator.accept(
            {"site": site, "classes": meta.get("classes"), "params": params, "num_samples": meta.get("num_samples")}
        )

    def _finish(self, minimum: int | None = None) -> tuple[RoundResult | None, dict[str, str]]:
        """The aggregate of the accepted answers; None when fewer than ``minimum`` (default
        ``min_clients``) are valid or the aggregation fails."""
        minimum = self.config.min_clients if minimum is None else minimum
        agg = self.aggregator
        rejected = dict(agg.rejected)
        if len(agg.accepted_sites) < minimum:
            self.warning(
                f"only {len(agg.accepted_sites)} valid result(s) (min_clients={minimum}); "
                "keeping the previous global model"
            )
            agg.reset()
            return None, rejected
        try:
            return agg.aggregate(), rejected
        except (ValueError, CxrflError) as exc:
            self.warning(f"aggregation failed, keeping the previous global model: {exc}")
            return None, {**rejected, "aggregation": str(exc)}

    # -------------------------------------------------------- selection
    def _consider(self, state: RunState, point: dict[str, Any], params: Mapping[str, Any]) -> None:
        """Score a model; keep it (and write ``best_FL_global_model.pt``) when it is the new best."""
        state.curve.append(point)
        if state.stopper.update(point["mean_val_loss"], point["round"]):
            state.best_params = dict(params)
            self._save_model(
                BEST_MODEL, state.best_params, state.classes, round=point["round"], mean_val_loss=point["mean_val_loss"]
            )

    def _validate_last(self, state: RunState) -> None:
        """Score the last aggregated model on the sites' validation splits (a run that did not stop
        early: otherwise it would never be scored and could never be selected)."""
        if state.curve and state.curve[-1]["round"] == state.round:
            return
        answers = self.exchange(
            VALIDATE, self.tasks.messages(state, state.params, split="val", model_round=state.round)
        )
        self.check_abort()
        point = curve_point(state.round, answers, "loss", "mean_auroc")
        self._consider(state, point, state.params)
        self._keep(state)
        self.record(
            {
                "round": state.round,
                "phase": "validate",
                "sites_answered": sorted(answers),
                "sites_failed": sorted(set(state.announced) - set(answers)),
                "evaluated_round": state.round,
                "mean_val_loss": point["mean_val_loss"],
                "mean_val_auroc": point["mean_val_auroc"],
                "site_metrics": {s: m.get("metrics") or {} for s, (_, m) in answers.items()},
            }
        )
        self.info(
            f"model of round {state.round}: mean val loss {fmt(point['mean_val_loss'])}, mean val AUROC "
            f"{fmt(point['mean_val_auroc'])}; selected round {state.stopper.best_step}"
        )

    def _selected(self, state: RunState) -> tuple[int, dict[str, np.ndarray]]:
        """The selected round and model (the last one when no model had a finite validation loss)."""
        if state.best_params is None or state.stopper.best_step is None:
            self.warning(
                "no model had a finite mean validation loss; the last global model is kept as the selected one"
            )
            self._save_model(BEST_MODEL, state.params, state.classes, round=state.round)
            return state.round, dict(state.params)
        return state.stopper.best_step, state.best_params

    # ------------------------------------------------------------ files
    def _keep(self, state: RunState) -> None:
        """Save what a resumed run needs; the global and selected models are the checkpoints just
        written (:data:`GLOBAL_MODEL`, :data:`BEST_MODEL`), linked rather than written again."""
        models = {"params": self.path(GLOBAL_MODEL)}
        if state.best_params is not None:
            models["best_params"] = self.path(BEST_MODEL)
        self.resume.save({**state.to_dict(), "settings": self.config.to_dict()}, models)

    def _save_model(self, name: str, params: Mapping[str, Any], classes: list[str], **extra: Any) -> Path:
        path = self.path(name)
        tensors = {k: torch.as_tensor(np.asarray(v)) for k, v in params.items()}
        save_checkpoint(
            path,
            tensors,
            classes=classes,
            model_config=self.config.model_config,
            extra={"head_mode": self.config.head_mode, **extra},
        )
        return path
