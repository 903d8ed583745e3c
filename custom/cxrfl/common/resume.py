"""What a server keeps so that an interrupted run goes on from its last completed step.

After the start-up and every completed round (cycle, stage) a server loop saves its state in
``<root>/<run id>/state.pt`` (atomically: a crash leaves the previous state). A model the server has
just written as a checkpoint (the global model, the selected one) is not written again: the state
names it, and the store keeps a hard link to that checkpoint file beside ``state.pt`` (a copy where
the two folders are on different file systems). A checkpoint is replaced by renaming a new file over
it, so the link keeps the model the state was saved with. A later run with ``resume_from=<run id>``
loads the state and the models it names, after checking that the settings that decide the model are
the same. A state written before models were linked holds them inline and resumes the same way.

``resume_from`` is a job setting, chosen by whoever submits the job: it is only ever a run id of
this store (no folder, no ``..``), and the state holds tensors and plain values only, read with
``weights_only=True`` (:func:`cxrfl.common.io.torch_load`). A run that finishes removes its folder.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cxrfl.common.io import link_or_copy, plain_name, torch_load, torch_save
from cxrfl.errors import ConfigError

RESUME_ROOT = "cxrfl_resume"
"""Folder under the server's workspace (NVFlare) or the output folder (in-process) holding resume states."""
RESUME_ROOT_ENV = "CXRFL_RESUME_ROOT"
"""Environment variable of the server's process naming another folder of resume states (set by the
server's operator, never by a job: e.g. simulator runs, whose workspace each run replaces)."""
STATE_FILE = "state.pt"
MODELS = "models"
"""Entry of a state naming its linked models: state key -> file name in the run's folder."""


class ResumeStore:
    """The resume states of one server.

    Args:
        root: the folder holding one sub-folder per run id.
        run_id: this run's id (NVFlare: the job id).
    """

    def __init__(self, root: str | Path, run_id: str) -> None:
        self.root = Path(root)
        self.run_id = str(run_id)
        self._names: dict[str, str] = {}  # the models the last saved state names (key -> file name)

    @property
    def folder(self) -> Path:
        """This run's folder."""
        return self.root / self.run_id

    def save(self, state: Mapping[str, Any], models: Mapping[str, Path] | None = None) -> Path:
        """Keep ``state`` (replaces the previous one atomically).

        Args:
            state: what the run needs to go on (must include ``settings``).
            models: state key -> the cxrfl checkpoint that holds that entry's model (its ``model``):
                linked, not written again; ``state``'s own value of the key is not saved.
        """
        names = {key: self._link(key, Path(source)) for key, source in (models or {}).items()}
        plain = {k: v for k, v in state.items() if k not in names}
        path = torch_save(self.folder / STATE_FILE, {**plain, MODELS: names})
        for stale in set(self._names.values()) - set(names.values()):  # after the state: a crash keeps them
            (self.folder / stale).unlink(missing_ok=True)
        self._names = names
        return path

    def _link(self, key: str, source: Path) -> str:
        """A file name in this run's folder holding ``source``'s content: the last state's name for ``key``
        when that file is ``source`` itself (a selected model unchanged since), else a new hard link (a
        copy across file systems)."""
        current = self._names.get(key)
        if current is not None and (self.folder / current).exists() and os.path.samefile(self.folder / current, source):
            return current
        name = f"{key}-{time.time_ns()}.pt"
        link_or_copy(source, self.folder / name)
        return name

    @staticmethod
    def check(resume_from: str) -> str:
        """``resume_from`` checked as a run id of a store (no folder, no ``..``).

        Args:
            resume_from: the setting's value.

        Raises:
            ConfigError: anything but a plain name (the message names ``resume_from``).
        """
        return plain_name(
            resume_from,
            "resume_from",
            "give the job id of an interrupted run of this job on this server, or remove resume_from",
        )

    def locate(self, resume_from: str) -> Path:
        """The state file of the run ``resume_from`` names (its folder under ``root``).

        Args:
            resume_from: the interrupted run's id.

        Raises:
            ConfigError: ``resume_from`` is not a plain run id.
        """
        return self.root / self.check(resume_from) / STATE_FILE

    def load(self, resume_from: str, settings: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
        """The interrupted run's state, refused when unusable.

        Args:
            resume_from: its run id.
            settings: this run's settings.
            keys: the settings that must be equal.

        Raises:
            ConfigError: not a run id, no state there, a state that cannot be read, or settings that
                differ (named).
        """
        path = self.locate(resume_from)
        if not path.is_file():
            raise ConfigError(
                f"resume_from={resume_from!r}: {path} does not exist; give the job id of an interrupted run of this "
                f"job on this server, or remove resume_from"
            )
        state = self.read(path)
        saved = state.get("settings") or {}
        differ = [k for k in keys if saved.get(k) != settings.get(k)]
        if differ:
            raise ConfigError(
                f"resume_from={resume_from!r}: the interrupted run used other settings for {differ}; "
                f"resume with the same settings or start a new run"
            )
        return state

    @staticmethod
    def read(path: Path, remedy: str | None = None) -> dict[str, Any]:
        """A state file's content with the models it names (tensors and plain values only; nothing in it is run).

        Args:
            path: a ``state.pt``.
            remedy: what to do when it cannot be read (default: start a new run).

        Raises:
            ConfigError: missing, damaged, of an older cxrfl, or not a state (one line naming it).
        """
        remedy = remedy or f"delete {path.parent} and submit the job without resume_from (start a new run)"
        state = torch_load(path, "resume state", remedy)
        if not isinstance(state, dict):
            raise ConfigError(
                f"resume state {path} cannot be read: it holds a {type(state).__name__}, not a state; {remedy}"
            )
        for key, name in (state.pop(MODELS, None) or {}).items():
            model = path.parent / plain_name(name, f"{path}: {MODELS}[{key!r}]", remedy)
            checkpoint = torch_load(model, "resume model", remedy)
            if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict):
                raise ConfigError(f"resume model {model} is not a cxrfl checkpoint; {remedy}")
            state[key] = checkpoint["model"]
        return state

    def clear(self) -> None:
        """Forget this run's state (it finished: nothing to resume)."""
        shutil.rmtree(self.folder, ignore_errors=True)
