"""What a server keeps so that an interrupted run goes on from its last completed step.

After the start-up and every completed round (cycle, stage) a server loop saves its state in
``<root>/<run id>/state.pt`` (atomically: a crash leaves the previous state). A later run with
``resume_from=<run id>`` (or the path of that folder) loads it, after checking that the settings
that decide the model are the same. A run that finishes removes its folder.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from cxrfl.common.io import torch_save
from cxrfl.errors import ConfigError

RESUME_ROOT = "cxrfl_resume"
"""Folder under the server's workspace (NVFlare) or the output folder (in-process) holding resume states."""
STATE_FILE = "state.pt"


class ResumeStore:
    """The resume states of one server.

    Args:
        root: the folder holding one sub-folder per run id.
        run_id: this run's id (NVFlare: the job id).
    """

    def __init__(self, root: str | Path, run_id: str) -> None:
        self.root = Path(root)
        self.run_id = str(run_id)

    @property
    def folder(self) -> Path:
        """This run's folder."""
        return self.root / self.run_id

    def save(self, state: Mapping[str, Any]) -> Path:
        """Keep ``state`` (replaces the previous one atomically).

        Args:
            state: what the run needs to go on (must include ``settings``).
        """
        return torch_save(self.folder / STATE_FILE, dict(state))

    def locate(self, resume_from: str) -> Path:
        """The state file ``resume_from`` names: a run id under ``root`` or an absolute folder.

        Args:
            resume_from: the interrupted run's id or folder.
        """
        given = Path(resume_from)
        folder = given if given.is_absolute() else self.root / resume_from
        return folder / STATE_FILE

    def load(self, resume_from: str, settings: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
        """The interrupted run's state, refused when unusable.

        Args:
            resume_from: its run id (or folder).
            settings: this run's settings.
            keys: the settings that must be equal.

        Raises:
            ConfigError: no state there, or settings that differ (named).
        """
        path = self.locate(resume_from)
        if not path.is_file():
            raise ConfigError(
                f"resume_from={resume_from!r}: {path} does not exist; give the job id of an interrupted run of this "
                f"job on this server (or the path of its {RESUME_ROOT}/<job id> folder), or remove resume_from"
            )
        state = torch.load(path, map_location="cpu", weights_only=False)
        saved = state.get("settings") or {}
        differ = [k for k in keys if saved.get(k) != settings.get(k)]
        if differ:
            raise ConfigError(f"resume_from={resume_from!r}: the interrupted run used other settings for {differ}; "
                              f"resume with the same settings or start a new run")
        return state

    def clear(self) -> None:
        """Forget this run's state (it finished: nothing to resume)."""
        shutil.rmtree(self.folder, ignore_errors=True)
