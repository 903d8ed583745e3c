"""FedFew's federated rounds (stage 1, stage 2's phases): FedAvg of the valid results, retries,
early stopping and the state a resumed run goes on from.

A stage runs as one or more :class:`Phase` s (stage 1: SimSiam; stage 2: warm-up, then energy
rounds, or plain BCE rounds). :meth:`FederatedRounds.run_phase` runs a phase's rounds:

- every result streams through the shared core's aggregator
  (:class:`cxrfl.core.streaming.StreamingFedAvg`): it is checked as a whole (:mod:`cxrfl.core.updates`:
  shapes, dtypes, missing or extra keys, NaN/Inf; :class:`cxrfl.core.updates.SampleCounts`: image counts
  capped and fixed per stage) before it is added to the running sum; a malformed one is rejected with
  one warning line naming the site and the reason (and in the round's ``rejected``); each accepted
  result's update norm and unchanged share go in the round's record (``update_norm``,
  ``unchanged_share``) and a norm far above the round's median is named in a warning line
  (:mod:`cxrfl.core.update_change`); the valid ones are averaged over all their keys, weighted by their
  images (``robust``: their median, or clipped updates). Stage 2's head is held whole by every site (the
  same classes), so it is plain FedAvg too: ``clip`` bounds one norm over the whole update (feature
  extractor and head together, as :func:`cxrfl.core.fedavg.fedavg_keys` does), not one per head row as
  surgical aggregation does (before issue 43 FedFew clipped each head row on its own);
- a round with fewer than ``min_clients`` valid results (at most the number of sites the phase
  trains: a warm-up round trains the CC sites only) changes nothing and is run again every
  ``retry_pause`` seconds (:class:`cxrfl.common.server.RetryClock`); after ``min_clients_timeout``
  seconds without a completed round the run stops (:class:`RunStopped`) with one line saying which
  stage and round, who answered, who was rejected and how to resume;
- after every completed round the stage's :class:`Progress` (last weights, best weights,
  early stopping, margins) is saved in the run's resume folder (``state.pt``) before the round's
  record is written: a run resumed with ``resume_from`` goes on with the next round of the
  stage in progress (its finished stages are loaded from their files);
- a scored phase asks for a validation loss after each round (the CC sites' validation BCE in
  stage 2); :class:`cxrfl.common.selection.EarlyStopping` ends the phase after ``patience``
  rounds without improvement, and the phase's result is its lowest-loss model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.common.io import to_numpy
from cxrfl.common.resume import STATE_FILE, ResumeStore
from cxrfl.common.selection import EarlyStopping
from cxrfl.common.server import RetryClock, ServerLoop
from cxrfl.common.transport import Message
from cxrfl.core.streaming import StreamingFedAvg
from cxrfl.core.update_change import change_fields, outlying_norms
from cxrfl.core.updates import MAX_NUM_SAMPLES, SampleCounts
from cxrfl.errors import ConfigError

log = logging.getLogger(__name__)

RoundHook = Callable[[int, int, Mapping[str, np.ndarray]], None]
"""``on_round(stage, round, weights)``: called after every completed round (and with round 0
and the initial weights before stage 1's first round); used by the benchmark's probes."""
Score = Callable[[Mapping[str, np.ndarray]], tuple[float | None, dict[str, Any]]]
"""A model's validation loss (None: nobody could score it) and the per-site details."""


@dataclass(frozen=True)
class Phase:
    """Rounds of one kind.

    Args:
        stage: 1 or 2.
        name: ``ssl``, ``warm-up``, ``energy`` or ``bce``.
        task: the task each round sends.
        max_rounds: the most rounds.
        sites: who trains.
        energy_weight: lambda of the round (stage 2).
        score: the validation loss of a new model (None: not scored; the last model is the result).
        patience: scored phases: rounds without improvement that end the phase.
        min_delta: scored phases: smallest improvement of the validation loss that counts.
    """

    stage: int
    name: str
    task: str
    max_rounds: int
    sites: tuple[str, ...]
    energy_weight: float = 0.0
    score: Score | None = None
    patience: int = 1
    min_delta: float = 0.0


@dataclass
class Progress:
    """Where a stage stands after its last completed round (what a resumed run goes on from).

    Args:
        stage: the stage.
        params: the last aggregated weights (the phase's start before its first round).
        phase: index of the phase in progress.
        round: rounds completed in the stage, over its phases.
        phase_round: rounds completed in the phase in progress.
        best: the phase's lowest-validation-loss weights (scored phases).
        best_round: their round.
        stopper: the phase's early stopping (:meth:`EarlyStopping.to_dict`).
        margins: stage 2's energy margins and how they were chosen.
        contributed: some round was aggregated (stage 1: else the weights are the initial ones).
    """

    stage: int
    params: dict[str, np.ndarray]
    phase: int = 0
    round: int = 0
    phase_round: int = 0
    best: dict[str, np.ndarray] | None = None
    best_round: int | None = None
    stopper: dict[str, Any] | None = None
    margins: dict[str, Any] = field(default_factory=dict)
    contributed: bool = False

    def to_state(self) -> dict[str, Any]:
        """Plain values with tensors (for ``torch.save``)."""

        def tensors(p: Mapping[str, Any] | None) -> dict[str, torch.Tensor] | None:
            return None if p is None else {k: torch.as_tensor(np.asarray(v)) for k, v in p.items()}

        return {
            "stage": self.stage,
            "params": tensors(self.params),
            "phase": self.phase,
            "round": self.round,
            "phase_round": self.phase_round,
            "best": tensors(self.best),
            "best_round": self.best_round,
            "stopper": self.stopper,
            "margins": dict(self.margins),
            "contributed": self.contributed,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Progress:
        """Rebuild from :meth:`to_state`.

        Args:
            state: the saved dict.
        """
        best = state.get("best")
        return cls(
            int(state["stage"]),
            to_numpy(state["params"]),
            int(state["phase"]),
            int(state["round"]),
            int(state["phase_round"]),
            None if best is None else to_numpy(best),
            state.get("best_round"),
            state.get("stopper"),
            dict(state.get("margins") or {}),
            bool(state.get("contributed")),
        )

    def next_phase(self, params: Mapping[str, np.ndarray]) -> None:
        """Start the next phase from ``params``."""
        self.params, self.phase, self.phase_round = dict(params), self.phase + 1, 0
        self.best = self.best_round = self.stopper = None


class FederatedRounds(ServerLoop):
    """Rounds with FedAvg, retries, early stopping and resume state (base of :class:`cxrfl.fedfew.server.FedFewServer`).

    Args:
        min_clients: fewest valid results that make a round.
        min_clients_timeout: seconds a round may be retried before the run stops.
        retry_pause: seconds between two attempts at a round.
        on_round: see :data:`RoundHook`.
        robust: None, ``median`` or ``clip`` (:class:`cxrfl.fedfew.config.FedFewConfig`).
        clip_norm: the norm bound of ``robust`` (None: each round's lower median update norm).
        max_num_samples: the largest image count a site may report.
        kwargs: :class:`cxrfl.common.server.ServerLoop`'s arguments.
    """

    def __init__(
        self,
        *,
        min_clients: int = 1,
        min_clients_timeout: float = 600,
        retry_pause: float = 10,
        on_round: RoundHook | None = None,
        robust: str | None = None,
        clip_norm: float | None = None,
        max_num_samples: int = MAX_NUM_SAMPLES,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if min_clients < 1:
            raise ValueError("min_clients must be >= 1")
        if min_clients_timeout < 0 or retry_pause < 0:
            raise ValueError("min_clients_timeout and retry_pause must be >= 0")
        self.min_clients = min_clients
        self.clock = RetryClock(min_clients_timeout, retry_pause)
        self.on_round = on_round
        self.robust, self.clip_norm, self.max_num_samples = robust, clip_norm, max_num_samples
        self.counts: dict[str, SampleCounts] = {}  # task -> each site's image count (SSL and stage 2 differ)
        self.progress_settings: dict[str, Any] = {}

    # ----------------------------------------------------------------- FedAvg
    def round_stream(
        self, expected: Mapping[str, tuple], *, reference: Mapping[str, np.ndarray], task: str
    ) -> StreamingFedAvg:
        """A round's aggregator (:class:`cxrfl.core.streaming.StreamingFedAvg`): FedAvg over all keys (stage 2's
        head too: every site holds every row), weighted by images; with ``robust``, the median (unweighted)
        or the clipped updates. Each answer handed to :meth:`take` is validated whole and, for the mean,
        added to the running sum and dropped as it arrives.

        Args:
            expected: name -> shape of the weights.
            reference: the weights the round started from (dtypes; what ``robust`` clips from).
            task: the round's task (image counts are checked per task).
        """
        stream = StreamingFedAvg(
            weighting="uniform" if self.robust == "median" else "samples",
            robust=self.robust,
            clip_norm=self.clip_norm,
            counts=self.counts.setdefault(task, SampleCounts(self.max_num_samples)),
        )
        stream.expect(expected, reference=reference)
        return stream

    def take(self, stream: StreamingFedAvg, site: str, answer: Message) -> None:
        """One site's answer into the round's aggregator (a rejection: one warning line)."""
        params, meta = answer
        if stream.accept({"site": site, "num_samples": meta.get("num_samples"), "params": params}) is None:
            self.warning(f"rejected the update of site {site}: {stream.rejected[site]}")

    @staticmethod
    def finish(stream: StreamingFedAvg, needed: int) -> tuple[dict[str, np.ndarray] | None, dict[str, str], list[str]]:
        """The round's average (None: fewer than ``needed`` valid results), site -> why it was rejected,
        the sites averaged."""
        rejected, used = dict(stream.rejected), stream.accepted_sites
        if len(used) < needed:
            stream.reset()
            return None, rejected, used
        return stream.aggregate(), rejected, used

    # ----------------------------------------------------------------- phases
    def run_phase(
        self,
        phase: Phase,
        progress: Progress,
        meta_for: Callable[[str, int], dict[str, Any]],
        expected: Mapping[str, tuple],
    ) -> dict[str, np.ndarray]:
        """Run a phase's remaining rounds; returns its result (the best scored model, else the last).

        Args:
            phase: the phase.
            progress: the stage's progress (updated and saved after every completed round).
            meta_for: (site, round) -> the task meta.
            expected: name -> shape of the weights.
        """
        stopper = None
        if phase.score is not None:
            stopper = (
                EarlyStopping.from_dict(progress.stopper)
                if progress.stopper
                else EarlyStopping(phase.patience, phase.min_delta)
            )
        while progress.phase_round < phase.max_rounds and not (stopper and stopper.should_stop):
            self._round(phase, progress, meta_for, expected, stopper)
        if stopper is not None and stopper.should_stop:
            self.info(
                f"stage {phase.stage} {phase.name}: early stop after {stopper.stale} round(s) without an "
                f"improvement of the validation loss by {phase.min_delta:g}; keeping round {progress.best_round}"
            )
        if phase.score is not None and progress.best is not None:
            return progress.best
        if phase.score is not None and progress.phase_round:
            self.warning(
                f"stage {phase.stage} {phase.name}: no round could be scored on the validation splits; "
                "keeping the last model"
            )
        return progress.params

    def _round(
        self,
        phase: Phase,
        progress: Progress,
        meta_for: Callable[[str, int], dict[str, Any]],
        expected: Mapping[str, tuple],
        stopper: EarlyStopping | None,
    ) -> None:
        """One attempt at the phase's next round (a failed attempt waits or stops the run)."""
        rnd = progress.round + 1
        start = time.perf_counter()
        stream = self.round_stream(expected, reference=progress.params, task=phase.task)
        results = self.broadcast(
            phase.task,
            phase.sites,
            progress.params,
            lambda s: meta_for(s, rnd),
            on_answer=lambda site, answer: self.take(stream, site, answer),  # validated and summed as it arrives
        )
        self.check_abort()  # aborted mid-round: the round is not recorded, nothing is written
        changes = dict(stream.changes)  # read before finish() forgets the round
        agg, rejected, used = self.finish(stream, self.needed(phase))
        metrics = {s: m.get("metrics") for s, (_, m) in results.items()}
        record: dict[str, Any] = {
            "stage": phase.stage,
            "round": rnd,
            "phase": phase.name,
            "sites_answered": sorted(results),
            "sites_aggregated": sorted(used) if agg is not None else [],  # answers arrive in any order
            "rejected": rejected,
            **change_fields(changes if agg is not None else {}),
            "site_metrics": metrics,
        }
        if phase.stage == 2:
            record.update(energy_weight=phase.energy_weight, margins=dict(progress.margins))
        if agg is None:
            self.record({**record, "status": "too_few_results", "seconds": time.perf_counter() - start})
            self._retry_or_stop(phase, rnd, record)
            return
        self.clock.succeeded()
        for line in outlying_norms({s: norm for s, (_, norm) in changes.items()}):
            self.warning(f"stage {phase.stage} round {rnd}: {line}")
        progress.params, progress.round, progress.contributed = agg, rnd, True
        progress.phase_round += 1
        if stopper is not None:
            loss, detail = phase.score(agg)
            record.update(val_loss=loss, site_validation=detail)
            if loss is not None and stopper.update(loss, rnd):
                progress.best, progress.best_round = agg, rnd
            progress.stopper = stopper.to_dict()
        record["seconds"] = time.perf_counter() - start
        self.save_progress(progress)
        self.record(record)  # after the resume state: a recorded round is never redone by a resumed run
        self.info(self._line(phase, progress, record, metrics))
        if self.on_round is not None:
            self.on_round(phase.stage, rnd, agg)

    def _line(self, phase: Phase, progress: Progress, record: Mapping[str, Any], metrics: Mapping[str, Any]) -> str:
        key = "ssl_loss" if phase.stage == 1 else "train_loss"
        losses = [m[key] for m in metrics.values() if m and m.get(key) is not None]
        loss = f"{np.mean(losses):.4f}" if losses else "n/a"
        val = ""
        if "val_loss" in record:
            v = record["val_loss"]
            val = f", CC validation loss {'n/a' if v is None else f'{v:.4f}'} (best round {progress.best_round})"
        return (
            f"stage {phase.stage} round {record['round']} ({phase.name} {progress.phase_round}/{phase.max_rounds}): "
            f"{len(record['sites_aggregated'])} site(s) aggregated, mean {key.replace('_', ' ')} {loss}{val} "
            f"({record['seconds']:.1f}s)"
        )

    def needed(self, phase: Phase) -> int:
        """Fewest valid results that make a round of ``phase``: ``min_clients``, at most the sites it trains
        (a warm-up round trains the CC sites only)."""
        return max(1, min(self.min_clients, len(phase.sites)))

    def _retry_or_stop(self, phase: Phase, rnd: int, record: Mapping[str, Any]) -> None:
        """After a failed attempt: wait and try the round again, or stop once ``min_clients_timeout`` is spent."""
        silent = sorted(set(phase.sites) - set(record["sites_answered"]))
        self.retry_or_stop(
            f"stage {phase.stage} round {rnd} had fewer than {self.needed(phase)} valid results "
            f"(min_clients={self.min_clients}; answered {record['sites_answered']}, no answer from {silent}, "
            f"rejected {dict(record['rejected'])})",
            setting="min_clients_timeout",
            kept=f"finished stages and the last completed round are kept in {self.resume.folder}; resume with "
            f"resume_from={self.run_id!r} once enough sites are back",
            step={"stage": phase.stage, "round": rnd, "phase": phase.name},
        )

    # --------------------------------------------------------- resume state
    def save_progress(self, progress: Progress) -> Path:
        """Keep the stage's progress in this run's resume folder (atomically)."""
        return self.resume.save({"settings": self.progress_settings, **progress.to_state()})

    def load_progress(self, folder: Path, stage: int) -> Progress | None:
        """The progress of ``stage`` an interrupted run left in ``folder`` (None: none, another stage,
        other settings or a file that cannot be read: the stage then starts over, with a warning for
        the last two).

        Args:
            folder: the interrupted run's resume folder.
            stage: the stage this run goes on with.
        """
        path = folder / STATE_FILE
        if not path.is_file():
            return None
        try:
            state = ResumeStore.read(path, remedy=f"stage {stage} starts over from its first round")
        except ConfigError as exc:
            self.warning(f"resume: {exc}")
            return None
        if int(state.get("stage", 0)) != stage:
            return None
        saved = state.get("settings") or {}
        differ = sorted(
            k for k in set(saved) | set(self.progress_settings) if saved.get(k) != self.progress_settings.get(k)
        )
        if differ:
            self.warning(
                f"resume: {path} holds stage {stage} after round {state.get('round')} but with other "
                f"settings ({differ}); stage {stage} starts over"
            )
            return None
        progress = Progress.from_state(state)
        self.info(f"resume: stage {stage} goes on after its round {progress.round} ({path})")
        return progress
