"""The relay of cyclical weight transfer, over any transport: the one loop that the NVFlare job
(:mod:`cxrfl.fl.cwt`), the benchmark and the tests (:mod:`cxrfl.cwt.inprocess`) run.

:class:`CWTServer` talks to the sites only through ``send`` (:mod:`cxrfl.common.transport`). It

1. sends a ``counts`` task to every site: each answers its number of training and validation
   images (and, for the multi-label task, its class names) and nothing else; with fewer than
   ``min_sites`` usable answers it asks again (every ``retry_pause`` seconds, until
   ``min_sites_timeout``), then stops with the reason;
2. turns the training sizes into each site's steps and learning rate (:func:`relay_plan`: PLTI
   and CLR when switched on);
3. every cycle, sends the model to one site at a time, in a fixed or seeded-shuffled order; the
   weights a site returns are the weights the next site receives, with Adam's state
   (``optimizer_state: travel``) and the relay's iteration count, so the learning-rate decay
   goes on where the previous site stopped. A site whose task fails, times out, or returns an
   unusable model is skipped with a log line and the model goes on unchanged. A cycle in
   which fewer than ``min_sites`` sites trained does not count: it is run again from the model
   it started with, until ``min_sites_timeout``, then the run stops with the reason;
4. after each cycle, sends the model to every site for a ``validate`` task; the pooled
   validation loss decides early stopping and which cycle's model is kept
   (:class:`cxrfl.common.selection.EarlyStopping`; never the untrained initial one);
5. after the start and every completed cycle, keeps what a resumed run needs (weights, Adam's
   state, iteration count, early-stopping state, best weights, cycle, plan, classes) with
   :class:`cxrfl.common.resume.ResumeStore` (the weights and best weights as links to the two
   checkpoints below: one model-sized write per cycle, plus Adam's state in the resume state);
   ``resume_from`` goes on from the next cycle.

Written under ``out_dir`` (the server's app folder in a job):

- ``FL_global_model.pt``: the model after the last completed cycle (a self-describing cxrfl
  checkpoint, readable by ``cxrfl predict`` at any time);
- ``best_FL_global_model.pt``: the model of the cycle with the lowest pooled validation loss;
- ``cxrfl/plan.json``: the classes and per site its training size, steps and learning rate;
- ``cxrfl/visits.jsonl``: one record per visit, in relay order: site, status (trained or
  skipped and why), the L2 norm of the site's change (``update_norm``; over 10x the cycle's median:
  a warning line naming the site) and its share of unchanged values (``unchanged_share``), SHA-256
  of the weights sent and received by the server, and of the weights the site loaded and returned
  as the site computed them, so anyone can check that the weights that left site k are the weights
  site k+1 started from;
- ``cxrfl/cycles.jsonl``: one record per cycle attempt (``completed``, ``too_few_sites``,
  ``stopped``, ``resumed``): order, sites trained and skipped, pooled validation loss;
- ``cxrfl/evaluation.json``: the best model on every site's test split (:mod:`cxrfl.cwt.evaluation`);
- ``cxrfl/run_config.json``: the settings of this run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.common.io import link_or_copy, params_digest, to_numpy, write_json
from cxrfl.common.selection import EarlyStopping
from cxrfl.common.server import BEST_MODEL, GLOBAL_MODEL, RECORDS_DIR, RetryClock, RunStopped, ServerLoop
from cxrfl.common.transport import Message, Send
from cxrfl.core.update_change import compare_to_sent, outlying_norms
from cxrfl.core.updates import FLOAT_DTYPES, INT_DTYPES, dtype_name, expected_dtypes, validate_update
from cxrfl.cwt.config import CWTConfig, RelayConfig
from cxrfl.cwt.evaluation import evaluate_final
from cxrfl.cwt.host import site_model_config
from cxrfl.cwt.relay import (
    COUNTS_TASK,
    TRAIN_TASK,
    VALIDATE_TASK,
    relay_order,
    relay_plan,
    relay_sites,
    split_params,
)
from cxrfl.cwt.site import global_classes, pooled_loss
from cxrfl.cwt.state import CycleRun, RelayPlan, RelayState
from cxrfl.errors import UpdateRejected
from cxrfl.nn.models import ModelConfig, build_model, save_checkpoint

RESUME_KEYS = ("cwt_config", "model_config", "site_order")
"""Settings a resumed run must share with the interrupted one."""


@dataclass
class CWTOutcome:
    """What a finished relay produced (also in the files under ``out_dir``).

    Args:
        plan: sites, classes, steps and rates.
        state: the state after the last completed cycle (``state.weights``: the final model).
        best_cycle: the cycle of the best model.
        best_val_loss: its pooled validation loss (NaN: no cycle had a finite one; the best
            model is then the last cycle's).
        best_weights: the best model.
        stopped_early: early stopping ended the run.
        resumed_after: the interrupted run's last completed cycle (None: not resumed).
        evaluation: the report written to ``cxrfl/evaluation.json``.
    """

    plan: RelayPlan
    state: RelayState
    best_cycle: int
    best_val_loss: float
    best_weights: dict[str, np.ndarray]
    stopped_early: bool
    resumed_after: int | None
    evaluation: dict[str, Any]


class CWTServer(ServerLoop):
    """The relay (see the module docstring).

    Args:
        send: the transport.
        sites: the sites taking part.
        config: the run's settings (sent to the sites).
        model_config: the network (``pretrained`` is read here, for the initial weights only).
        relay: site order, ``min_sites``, retry and evaluation settings.
        out_dir: where results go.
        common: the other :class:`cxrfl.common.server.ServerLoop` arguments (run id, resume
            root, ``resume_from``, loggers, abort check).
    """

    def __init__(
        self,
        send: Send,
        *,
        sites: list[str],
        config: CWTConfig,
        model_config: ModelConfig,
        relay: RelayConfig | None = None,
        out_dir: str | Path,
        **common: Any,
    ) -> None:
        super().__init__(send, sites=sites, out_dir=out_dir, **common)
        self.config = config
        self.model_config = model_config
        self.relay = relay or RelayConfig()
        self.clock = RetryClock(self.relay.min_sites_timeout, self.relay.retry_pause)
        self.settings = {
            "cwt_config": config.to_dict(),
            "model_config": model_config.to_dict(),
            **self.relay.to_dict(),
            "method": config.method,
            "resume_from": self.resume_from,
        }

    # -------------------------------------------------------------- helpers
    def _meta(self, classes: list[str] | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "cwt_config": self.config.to_dict(),
            "model_config": site_model_config(self.model_config).to_dict(),
            "classes": classes,
            **extra,
        }

    def _ask(self, task: str, payloads: dict[str, Message]) -> dict[str, Message]:
        """:meth:`exchange`, then stop at once (nothing written) when the run was aborted meanwhile."""
        answers = self.exchange(task, payloads)
        self.check_abort()
        return answers

    def _checkpoint(self, name: str, weights: Mapping[str, np.ndarray], plan: RelayPlan, **extra: Any) -> Path:
        path = self.path(name)
        save_checkpoint(
            path,
            {k: torch.as_tensor(np.asarray(v)) for k, v in weights.items()},
            classes=plan.classes,
            model_config=self.model_config,
            extra={"method": self.config.method, "cwt_config": self.config.to_dict(), **extra},
        )
        return path

    def _keep(self, plan: RelayPlan, state: RelayState) -> None:
        """Save what a resumed run needs (after the start and every completed cycle); the model and the best
        one are the checkpoints just written (:data:`GLOBAL_MODEL`, :data:`BEST_MODEL`), linked rather than
        written again."""
        models = {"weights": self.path(GLOBAL_MODEL)}
        if state.best_weights is not None:
            models["best_weights"] = self.path(BEST_MODEL)
        state_dict = {"settings": self.settings, "run_id": self.run_id, "plan": plan.to_dict(), **state.to_dict()}
        self.resume.save(state_dict, models)

    def _retry(self, problem: str, cycle: int | None) -> None:
        """Wait before another attempt, or stop with the reason once ``min_sites_timeout`` has passed."""
        kept = (
            f"the last completed cycle ({cycle - 1}) is in {self.path(GLOBAL_MODEL)}; resume with "
            f"resume_from={self.run_id!r} once enough sites are back"
            if cycle
            else "check the sites' logs"
        )
        step = {"cycle": cycle} if cycle else None
        self.retry_or_stop(problem, setting="min_sites_timeout", kept=kept, step=step, name="cycles.jsonl")

    def run(self) -> CWTOutcome:
        """Run (or resume) the relay; write and return the results.

        Raises:
            RunStopped: too few sites for ``min_sites_timeout``, no class, or an unusable
                ``resume_from`` (the message says why).
            RunAborted: the abort check said so (nothing more is written).
        """
        cfg = self.config
        self.info(
            f"cyclical weight transfer ({cfg.method}, task {cfg.task}): up to {cfg.num_cycles} cycles, order "
            f"{cfg.order}, optimizer state {cfg.optimizer_state}, min_sites {self.relay.min_sites}"
        )
        self.write_run_config(self.settings)
        plan, state = self._resume() if self.resume_from else self._start()
        resumed_after = state.cycle if self.resume_from else None
        stopped_early = self._relay(plan, state)
        best_cycle, best_loss, best = self._best(plan, state)
        evaluation = evaluate_final(self, plan, best, best_cycle, method=cfg.method, relay=self.relay, meta=self._meta)
        self.resume.clear()
        return CWTOutcome(plan, state, best_cycle, best_loss, best, stopped_early, resumed_after, evaluation)

    def _start(self) -> tuple[RelayPlan, RelayState]:
        cfg = self.config
        counts = self._counts()
        classes = global_classes(cfg.task, {s: c.get("classes") or [] for s, c in counts.items()})
        if not classes:
            raise RunStopped("the sites announced no class; check their site configs")
        plan = RelayPlan(
            relay_sites(list(counts), self.relay.site_order),
            classes,
            relay_plan({s: int(c["n_train"]) for s, c in counts.items()}, cfg),
            counts,
        )
        torch.manual_seed(cfg.seed)
        weights = to_numpy(build_model(self.model_config, len(classes)).state_dict())
        state = RelayState(0, weights, {}, 0, EarlyStopping(cfg.patience, cfg.min_delta))
        self._write_plan(plan)
        self._checkpoint(GLOBAL_MODEL, weights, plan, cycle=0)
        self._keep(plan, state)
        return plan, state

    def _counts(self) -> dict[str, dict[str, Any]]:
        """The sites' counts, asked again until ``min_sites`` can take part."""
        while True:
            answers = self._ask(COUNTS_TASK, {s: ({}, self._meta()) for s in self.sites})
            counts: dict[str, dict[str, Any]] = {}
            for s in self.sites:
                c = answers[s][1].get("counts") if s in answers else None
                if not isinstance(c, Mapping):
                    self.warning(
                        f"site {s} did not answer the counts task (down or failing); it is left out of the relay"
                    )
                elif int(c.get("n_train", 0)) <= 0:
                    self.warning(f"site {s} has no training images; it is left out of the relay")
                else:
                    counts[s] = dict(c)
            if len(counts) >= self.relay.min_sites:
                self.clock.succeeded()
                return counts
            self._retry(f"only {len(counts)} site(s) can take part (min_sites={self.relay.min_sites})", None)

    def _write_plan(self, plan: RelayPlan) -> None:
        write_json(
            self.path(RECORDS_DIR, "plan.json"),
            {
                "classes": plan.classes,
                "relay": plan.relay,
                "sites": {
                    s: {
                        "n_train": int(plan.counts[s]["n_train"]),
                        "n_val": int(plan.counts[s].get("n_val", 0)),
                        "steps": plan.visits[s].steps,
                        "lr": plan.visits[s].lr,
                    }
                    for s in plan.relay
                },
            },
        )
        self.info(
            "relay plan: "
            + ", ".join(f"{s} {plan.visits[s].steps} steps at lr {plan.visits[s].lr:.3g}" for s in plan.relay)
            + f"; {len(plan.classes)} output(s)"
        )

    def _resume(self) -> tuple[RelayPlan, RelayState]:
        saved = self.load_resume(self.settings, RESUME_KEYS)
        plan, state = RelayPlan.from_dict(saved["plan"]), RelayState.from_dict(saved)
        self._write_plan(plan)
        self._checkpoint(GLOBAL_MODEL, state.weights, plan, cycle=state.cycle)
        if state.best_weights is not None:
            self._checkpoint(
                BEST_MODEL, state.best_weights, plan, cycle=state.stopping.best_step, val_loss=state.stopping.best
            )
        self._keep(plan, state)
        self.record(
            {"cycle": state.cycle, "status": "resumed", "resumed_from": self.resume_from, "iteration": state.iteration},
            "cycles.jsonl",
        )
        self.info(f"resumed {self.resume_from} after its cycle {state.cycle}: continuing with cycle {state.cycle + 1}")
        return plan, state

    # ---------------------------------------------------------------- relay
    def _relay(self, plan: RelayPlan, state: RelayState) -> bool:
        """The cycles; True when early stopping ended them."""
        attempt = 1
        while state.cycle < self.config.num_cycles and not state.stopping.should_stop:
            run = self._cycle(plan, state, attempt)
            if len(run.trained) < self.relay.min_sites:
                self._too_few(run)
                attempt += 1
                continue
            self.clock.succeeded()
            attempt = 1
            self._complete(plan, state, run)
        if state.stopping.should_stop:
            self.info(
                f"early stop: no improvement for {state.stopping.stale} cycles (best cycle {state.stopping.best_step})"
            )
        return state.stopping.should_stop

    def _cycle(self, plan: RelayPlan, state: RelayState, attempt: int) -> CycleRun:
        """One pass of the model over the sites, from the last completed cycle's model."""
        cycle = state.cycle + 1
        order = relay_order(plan.relay, cycle, self.config.order, self.config.seed)
        run = CycleRun(cycle, attempt, order, state.weights, state.optimizer, state.iteration)
        start = time.perf_counter()
        for position, site in enumerate(order):
            self._visit(plan, run, site, position)
        run.seconds = time.perf_counter() - start
        norms = {v["site"]: v["update_norm"] for v in run.visits if "update_norm" in v}
        for line in outlying_norms(norms, advice="check that site (a relay passes on what each site returns)"):
            self.warning(f"cycle {cycle}: {line}")
        return run

    def _visit(self, plan: RelayPlan, run: CycleRun, site: str, position: int) -> None:
        visit = plan.visits[site]
        meta = self._meta(
            plan.classes, cycle=run.cycle, position=position, steps=visit.steps, lr=visit.lr, iteration=run.iteration
        )
        record: dict[str, Any] = {
            "cycle": run.cycle,
            "attempt": run.attempt,
            "position": position,
            "site": site,
            "iteration": run.iteration,
            "sent_digest": params_digest(run.weights),
        }
        answer = self._ask(TRAIN_TASK, {site: ({**run.weights, **run.optimizer}, meta)}).get(site)
        problem = self._check(answer, site, plan, run.weights)
        if problem:
            run.skipped[site] = problem
            record.update(status="skipped", reason=problem)
            self.warning(
                f"cycle {run.cycle}: site {site} skipped ({problem}); the model goes on to the next site unchanged"
            )
        else:
            params, opt = split_params(answer[0])
            metrics = dict(answer[1].get("metrics") or {})
            change = compare_to_sent(params, run.weights)  # the norm of what this site changed
            if change is not None:
                record.update(unchanged_share=round(change[0], 6), update_norm=round(change[1], 6))
            run.weights = {k: np.asarray(v) for k, v in params.items()}
            run.optimizer = (
                {k: np.asarray(v) for k, v in opt.items()} if self.config.optimizer_state == "travel" else {}
            )
            run.iteration += int(metrics.get("steps", visit.steps))
            record.update(
                status="trained",
                received_digest=params_digest(run.weights),
                site_received_digest=metrics.pop("received_digest", None),
                site_returned_digest=metrics.pop("returned_digest", None),
                metrics=metrics,
            )
            run.trained.append(site)
        self.record(record, "visits.jsonl")
        run.visits.append(record)

    def _check(self, answer: Message | None, site: str, plan: RelayPlan, sent: Mapping[str, np.ndarray]) -> str | None:
        """Why a site's answer cannot go on to the next site, or None (the whole answer is checked:
        the model's keys, shapes, dtypes (those of ``sent``) and values; the optimiser state's types and values)."""
        if answer is None:
            return "its task failed or timed out, or the site is down"
        params, opt = split_params(answer[0])
        shapes = {k: tuple(v.shape) for k, v in sent.items()}
        n = int(plan.counts[site].get("n_train", 1))
        try:
            validate_update(
                {"site": site, "classes": plan.classes, "num_samples": max(n, 1), "params": params},
                expected_shapes=shapes,
                dtypes=expected_dtypes(sent),
            )
        except UpdateRejected as exc:
            return f"unusable result: {exc}"
        arrays = {k: np.asarray(v) for k, v in opt.items()}
        odd = sorted(k for k, v in arrays.items() if dtype_name(v) not in FLOAT_DTYPES | INT_DTYPES)
        if odd:
            return f"unusable result: optimizer state {odd[:3]} is not real numbers ({dtype_name(arrays[odd[0]])})"
        bad = sorted(k for k, v in arrays.items() if not np.isfinite(v).all())
        return f"unusable result: non-finite optimizer state {bad[:3]}" if bad else None

    def _too_few(self, run: CycleRun) -> None:
        """A cycle with fewer than ``min_sites`` trained sites: recorded, not counted, run again or the stop."""
        self.record(
            {
                "cycle": run.cycle,
                "status": "too_few_sites",
                "attempt": run.attempt,
                "order": run.order,
                "trained": run.trained,
                "skipped": run.skipped,
                "seconds": run.seconds,
            },
            "cycles.jsonl",
        )
        self._retry(
            f"cycle {run.cycle}: only {len(run.trained)} site(s) trained (min_sites={self.relay.min_sites}; "
            f"skipped: {run.skipped}); the cycle does not count",
            run.cycle,
        )

    def _complete(self, plan: RelayPlan, state: RelayState, run: CycleRun) -> None:
        """Validate a counted cycle, keep its model (and the best), save the state, record it."""
        val = self._validate(run.weights, plan, "val", run.cycle)
        loss = pooled_loss([(m.get("loss", math.nan), m.get("n_known", 0)) for m in val.values()])
        state.cycle, state.weights, state.optimizer, state.iteration = (
            run.cycle,
            run.weights,
            run.optimizer,
            run.iteration,
        )
        improved = state.stopping.update(loss, run.cycle)
        self._checkpoint(GLOBAL_MODEL, state.weights, plan, cycle=run.cycle, val_loss=loss)
        if improved:
            state.best_weights = state.weights
            link_or_copy(self.path(GLOBAL_MODEL), self.path(BEST_MODEL))  # the same checkpoint: no second write
        record = {
            "cycle": run.cycle,
            "status": "completed",
            "attempt": run.attempt,
            "order": run.order,
            "trained": run.trained,
            "skipped": run.skipped,
            "val_loss": loss,
            "sites_validated": sorted(val),
            "iteration": state.iteration,
            "best_cycle": state.stopping.best_step,
            "seconds": run.seconds,
        }
        state.history.append({**record, "visits": run.visits})
        self._keep(plan, state)
        self.record(record, "cycles.jsonl")
        self.info(
            f"cycle {run.cycle} ({' > '.join(run.order)}): {len(run.trained)} site(s) trained, "
            f"{len(run.skipped)} skipped, pooled val loss {loss:.4f} ({run.seconds:.1f}s)"
        )

    def _validate(
        self, weights: Mapping[str, np.ndarray], plan: RelayPlan, split: str, cycle: int | None = None
    ) -> dict[str, dict[str, Any]]:
        answers = self._ask(
            VALIDATE_TASK, {s: (dict(weights), self._meta(plan.classes, split=split, cycle=cycle)) for s in plan.relay}
        )
        return {s: dict(a[1].get("metrics") or {}) for s, a in answers.items()}

    # --------------------------------------------------------------- finish
    def _best(self, plan: RelayPlan, state: RelayState) -> tuple[int, float, dict[str, np.ndarray]]:
        """The best cycle, its loss and model (the last cycle's when no cycle had a finite loss)."""
        es = state.stopping
        if es.best_step is None or state.best_weights is None:
            self.warning(
                "no cycle had a finite pooled validation loss (did any site validate?); the best model is the "
                f"last cycle's ({state.cycle})"
            )
            self._checkpoint(BEST_MODEL, state.weights, plan, cycle=state.cycle, val_loss=math.nan)
            return state.cycle, math.nan, state.weights
        self.info(
            f"global model: {self.path(GLOBAL_MODEL)} (cycle {state.cycle}); best (cycle {es.best_step}, pooled val "
            f"loss {es.best:.4f}): {self.path(BEST_MODEL)}"
        )
        return es.best_step, es.best, state.best_weights
