"""What every transport-free server loop shares: output files, resuming, sending, aborting, retrying, time.

A method's server (:class:`cxrfl.surgical.server.SurgicalServer`, :class:`cxrfl.cwt.server.CWTServer`,
:class:`cxrfl.fedfew.server.FedFewServer`) derives from :class:`ServerLoop`. It talks to the
sites only through ``send`` (:mod:`cxrfl.common.transport`), writes under ``out_dir`` (the
server's app folder in an NVFlare job), logs through ``info``/``warning`` and checks
``aborted``. It raises :class:`RunStopped` when it cannot go on (NVFlare: the job panics with the
reason) and :class:`RunAborted` when told to stop (nothing more is written).
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

import cxrfl
from cxrfl.common.io import append_record, json_default, owner_only, write_json
from cxrfl.common.resume import RESUME_ROOT, ResumeStore
from cxrfl.common.transport import Message, OnAnswer, Send
from cxrfl.errors import ConfigError, CxrflError

log = logging.getLogger(__name__)

RECORDS_DIR = "cxrfl"
"""Sub-folder of the output folder with run records (``rounds.jsonl`` ...), ``run_config.json``, ``evaluation.json``."""
GLOBAL_MODEL = "FL_global_model.pt"
"""The latest global model (a cxrfl checkpoint) in the output folder, replaced after every completed round."""
BEST_MODEL = "best_FL_global_model.pt"
"""The selected global model (lowest validation loss so far) in the output folder."""
CHECKPOINTS = "checkpoints"
"""Sub-folder of :data:`RECORDS_DIR` with every round's global model (``round_NNN.pt``), where a method keeps them."""


class RunStopped(CxrflError):
    """The run cannot go on; the message says why and what to do."""


class RunAborted(Exception):
    """The run was told to stop from outside (NVFlare's abort signal)."""


class RetryClock:
    """How long a step (round, visit, stage) has been retried, and whether to give up.

    Args:
        timeout: seconds of failed attempts before giving up (0: give up at the first failure).
        pause: seconds between two attempts.
    """

    def __init__(self, timeout: float, pause: float) -> None:
        self.timeout = float(timeout)
        self.pause = float(pause)
        self.since: float | None = None

    def failed(self) -> float:
        """Note a failed attempt; returns the seconds since the first failure in a row."""
        if self.since is None:
            self.since = time.monotonic()
        return time.monotonic() - self.since

    def succeeded(self) -> None:
        """Note a completed step (the next failure starts a new clock)."""
        self.since = None

    @property
    def expired(self) -> bool:
        """The failures have lasted ``timeout`` seconds."""
        return self.since is not None and time.monotonic() - self.since >= self.timeout

    def wait(self, aborted: Callable[[], bool]) -> None:
        """Sleep ``pause`` seconds before the next attempt, waking early on an abort.

        Args:
            aborted: returns True when the run must stop.
        """
        end = time.monotonic() + self.pause
        while time.monotonic() < end and not aborted():
            time.sleep(min(0.2, max(end - time.monotonic(), 0)))


class TimeBudget:
    """Whether one more step (a round) fits a time budget, judged at the pace of the slowest step so far.

    Args:
        seconds: the budget, counted from :meth:`start` (None: no budget).
    """

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.started = time.monotonic()
        self.slowest = 0.0

    def start(self) -> None:
        """Start counting (the run's start)."""
        self.started = time.monotonic()

    def took(self, seconds: float) -> None:
        """Note the length of a completed step."""
        self.slowest = max(self.slowest, seconds)

    def overrun(self) -> float | None:
        """The seconds spent when a step as slow as the slowest so far would end after the budget, else None
        (a step that would end exactly on the budget still fits)."""
        elapsed = time.monotonic() - self.started
        return None if self.seconds is None or elapsed + self.slowest <= self.seconds else elapsed


class ServerLoop:
    """Base of the methods' server loops.

    Args:
        send: the transport.
        sites: the sites taking part.
        out_dir: where results go.
        run_id: this run's id (NVFlare: the job id); names its resume state.
        resume_root: folder of resume states (default ``out_dir/cxrfl_resume``; NVFlare: the
            server workspace's ``cxrfl_resume``).
        resume_from: an interrupted run's id (of ``resume_root``) to go on from.
        info: progress logger.
        warning: problem logger.
        aborted: returns True when the run must stop.

    Raises:
        ConfigError: ``resume_from`` is not a plain run id (a folder, ``..``).
    """

    on_record: Callable[[str, Mapping[str, Any]], None] | None = None
    """Called with ``(name, record)`` after each :meth:`record` (NVFlare: the job's experiment tracking)."""

    def __init__(
        self,
        send: Send,
        *,
        sites: Sequence[str],
        out_dir: str | Path,
        run_id: str = "run",
        resume_root: str | Path | None = None,
        resume_from: str | None = None,
        info: Callable[[str], None] = log.info,
        warning: Callable[[str], None] = log.warning,
        aborted: Callable[[], bool] = lambda: False,
    ) -> None:
        self.send = send
        self.sites = list(sites)
        self.out = Path(out_dir)
        self.run_id = str(run_id)
        self.resume = ResumeStore(resume_root if resume_root is not None else self.out / RESUME_ROOT, self.run_id)
        self.resume_from = ResumeStore.check(resume_from) if resume_from else None
        self.info = info
        self.warning = warning
        self.aborted = aborted
        self.clock = RetryClock(0, 0)  # each method sets its own timeout and pause

    # ----------------------------------------------------------------- files
    def path(self, *parts: str) -> Path:
        """A path under the output folder (its folders created, owner-only: they name sites per class).

        Args:
            parts: path components.
        """
        path = self.out.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        owner_only(path.parent, up_to=self.out)
        return path

    def record(self, record: Mapping[str, Any], name: str = "rounds.jsonl") -> None:
        """Append one record to ``cxrfl/<name>``.

        Args:
            record: the record.
            name: the ``.jsonl`` file.
        """
        path = self.path(RECORDS_DIR, name)
        append_record(path, dict(record))
        owner_only(path)
        if self.on_record is not None:
            self.on_record(name, record)

    def write_run_config(self, settings: Mapping[str, Any]) -> Path:
        """``cxrfl/run_config.json``: the settings and the versions that ran them.

        Args:
            settings: the run's settings.
        """
        return write_json(
            self.path(RECORDS_DIR, "run_config.json"),
            {
                **settings,
                "cxrfl_version": cxrfl.__version__,
                "python": platform.python_version(),
                "torch": torch.__version__,
            },
        )

    def write_evaluation(self, report: Mapping[str, Any]) -> Path:
        """``cxrfl/evaluation.json``.

        Args:
            report: the evaluation.
        """
        path = self.path(RECORDS_DIR, "evaluation.json")
        path.write_text(json.dumps(report, indent=2, default=json_default))
        owner_only(path)
        self.info(f"evaluation written to {path}")
        return path

    def load_resume(self, settings: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
        """The interrupted run's state (``resume_from``), refused with the reason when unusable.

        Args:
            settings: this run's settings.
            keys: the settings a resumed run must share with the interrupted one.

        Raises:
            RunStopped: no state there, one that cannot be read, or other settings (the message says which).
        """
        if self.resume_from is None:
            raise RunStopped("there is no interrupted run to resume (resume_from is not set)")
        try:
            return self.resume.load(self.resume_from, settings, keys)
        except ConfigError as exc:
            raise RunStopped(str(exc)) from None

    # ------------------------------------------------------------ stopping
    def stop(self, reason: str, step: Mapping[str, Any] | None = None, name: str = "rounds.jsonl") -> NoReturn:
        """Stop the run: one ``stopped`` record (``step``'s fields, ``status: stopped``, the reason), then
        :class:`RunStopped`. The same record schema in every method.

        Args:
            reason: why, and what to do (one line).
            step: the fields that name the step that could not be completed (None: no record).
            name: the ``.jsonl`` file of the record.
        """
        if step is not None:
            self.record({**step, "status": "stopped", "reason": reason}, name)
        raise RunStopped(reason)

    def retry_or_stop(
        self, problem: str, *, setting: str, kept: str, step: Mapping[str, Any] | None, name: str = "rounds.jsonl"
    ) -> None:
        """After a failed attempt at a step: wait ``clock.pause`` seconds (the caller tries again), or, once
        failures have lasted ``clock.timeout`` seconds, :meth:`stop`.

        Args:
            problem: what failed (``round 3 had fewer than min_clients=2 valid results``).
            setting: the name of the timeout setting, for the messages.
            kept: what is kept and how to go on, for the stop message.
            step: the fields that name the step (see :meth:`stop`).
            name: the ``.jsonl`` file of the stopped record.
        """
        waited = self.clock.failed()
        if self.clock.expired:
            self.stop(f"stopping: {problem} for {waited:.0f}s ({setting}={self.clock.timeout:g}); {kept}", step, name)
        self.warning(
            f"{problem}; running it again in {self.clock.pause:g}s ({waited:.0f}s of {setting}={self.clock.timeout:g}s)"
        )
        self.clock.wait(self.aborted)
        self.check_abort()

    # --------------------------------------------------------------- sending
    def run(self) -> Any:
        """Run the method to its end (each method's loop implements it)."""
        raise NotImplementedError

    def check_abort(self) -> None:
        """Raise :class:`RunAborted` when the run must stop."""
        if self.aborted():
            raise RunAborted()

    def exchange(
        self, task: str, payloads: dict[str, Message], on_answer: OnAnswer | None = None
    ) -> dict[str, Message]:
        """Send one message per site; warn about each site without an answer.

        Args:
            task: the task name.
            payloads: site -> its message.
            on_answer: streams the answers (see :class:`cxrfl.common.transport.Send`): each is
                handed to it as it arrives and comes back as ``({}, meta)``.

        Returns:
            the answers of the sites that succeeded.
        """
        self.check_abort()
        answers = self.send(task, payloads) if on_answer is None else self.send(task, payloads, on_answer=on_answer)
        for site in payloads:
            if site not in answers:
                self.warning(
                    f"{task}: site {site} gave no result (failed, timed out or down; see its log); going on without it"
                )
        return {s: a for s, a in answers.items() if s in payloads}

    def broadcast(
        self,
        task: str,
        sites: Sequence[str],
        params: Mapping[str, Any],
        meta_for: Callable[[str], dict[str, Any]],
        on_answer: OnAnswer | None = None,
    ) -> dict[str, Message]:
        """The same parameters to several sites, each with its own settings.

        Args:
            task: the task name.
            sites: the receivers.
            params: the parameters every site gets.
            meta_for: site -> its meta.
            on_answer: streams the answers (see :meth:`exchange`).
        """
        return self.exchange(task, {s: (dict(params), meta_for(s)) for s in sites}, on_answer=on_answer)
