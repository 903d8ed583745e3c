"""A deployment workspace: what was provisioned into it, and how NVFlare commands and processes run in it.

A deployment workspace ``WS`` holds everything: ``WS/project.yml`` (the effective project file),
the kits (``WS/prod/<project>/prod_NN/<participant>`` or ``WS/poc/<project>/prod_00/...``),
``WS/home/<participant>`` and ``WS/tmp/<participant>`` (``HOME`` and ``TMPDIR`` of every process
started here, where NVFlare writes ``~/.nvflare``), ``WS/cxrfl_deploy.json`` (what was provisioned:
:class:`Deployment`) and ``WS/cxrfl_processes.json`` (what was started). Nothing is written outside ``WS``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cxrfl.errors import CxrflError
from cxrfl.fl.site_config import SITE_CONFIG_DIR_ENV, SITE_CONFIG_ENV

STATE_FILE = "cxrfl_deploy.json"
# site processes read their data config from local/; these would override it (see cxrfl.fl.site_config)
_SITE_ENV_OVERRIDES = (SITE_CONFIG_ENV, SITE_CONFIG_DIR_ENV)


class DeployError(CxrflError):
    """A deployment step failed; the message says which and what to do."""


@dataclass
class Deployment:
    """What ``provision`` made (saved as ``WS/cxrfl_deploy.json``).

    Args:
        workspace: the deployment workspace.
        mode: ``prod`` or ``poc``.
        project: the project name.
        kits: the folder holding one kit per participant.
        server: the server's participant name.
        clients: the client (hospital) names.
        admins: admin name -> role.
        host: the host sites and admins connect to.
        port: the server's port (FL and admin traffic).
        orgs: participant -> its organisation.
    """

    workspace: str
    mode: str
    project: str
    kits: str
    server: str
    clients: list[str]
    admins: dict[str, str]
    host: str
    port: int
    orgs: dict[str, str] = field(default_factory=dict)

    @property
    def ws(self) -> Path:
        """The workspace folder."""
        return Path(self.workspace)

    def kit(self, name: str) -> Path:
        """The kit folder of a participant (``server`` is an alias of the server's name).

        Args:
            name: the participant.
        """
        name = self.server if name == "server" else name
        path = Path(self.kits) / name
        if not path.is_dir():
            raise DeployError(
                f"no kit for {name!r} in {self.kits}; participants: {[self.server, *self.clients, *self.admins]}"
            )
        return path

    def admin_with_role(self, role: str) -> str:
        """The first admin with ``role`` (e.g. ``project_admin``).

        Args:
            role: the role.
        """
        for name, r in self.admins.items():
            if r == role:
                return name
        raise DeployError(f"the project has no admin with role {role!r}")

    def save(self) -> None:
        """Write ``WS/cxrfl_deploy.json``."""
        (self.ws / STATE_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, workspace: str | Path) -> Deployment:
        """The deployment a workspace holds (a :class:`DeployError` if none).

        Args:
            workspace: the deployment workspace.
        """
        path = Path(workspace).resolve() / STATE_FILE
        if not path.is_file():
            raise DeployError(
                f"{workspace} is not a deployment workspace (no {STATE_FILE}); run `cxrfl deploy provision` first"
            )
        return cls(**json.loads(path.read_text()))


def nvflare_command() -> str:
    """The ``nvflare`` executable beside the running Python (else the one on ``PATH``)."""
    exe = Path(sys.executable).with_name("nvflare")
    return str(exe) if exe.exists() else (shutil.which("nvflare") or "nvflare")


def process_env(workspace: Path, name: str, *, poc_workspace: Path | None = None) -> dict[str, str]:
    """Environment of an NVFlare command or process started for participant ``name``.

    ``HOME`` and ``TMPDIR`` point into the workspace (NVFlare writes ``~/.nvflare/config.conf``),
    the running Python's ``bin`` comes first on ``PATH`` (``sub_start.sh`` calls bare ``python3``),
    and ``CXRFL_SITE_CONFIG``/``CXRFL_SITE_CONFIG_DIR`` are removed so each site reads its own
    ``local/cxrfl_site.yaml``.

    Args:
        workspace: the deployment workspace.
        name: the participant (``cli`` for commands run on the operator's behalf).
        poc_workspace: NVFlare's POC workspace (POC mode).
    """
    env = {k: v for k, v in os.environ.items() if k not in _SITE_ENV_OVERRIDES}
    home = workspace / "home" / name
    tmp = workspace / "tmp" / name
    home.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if poc_workspace is not None:
        env["NVFLARE_POC_WORKSPACE"] = str(poc_workspace)
    return env


def run_command(cmd: list[str], env: dict[str, str], what: str, timeout: float = 600, cwd: Path | None = None) -> str:
    """Run an NVFlare command to its end; its stdout, or a :class:`DeployError` naming the step and its output.

    Args:
        cmd: the command.
        env: its environment (:func:`process_env`).
        what: the step, for messages.
        timeout: seconds it may take.
        cwd: its working folder.
    """
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        raise DeployError(f"{what} did not finish within {timeout:.0f}s: {' '.join(cmd)}") from exc
    if proc.returncode != 0:
        raise DeployError(
            f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``.

    Args:
        host: the interface.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface."""
    return host.rstrip(".").lower() == "localhost" or host.startswith("127.")
