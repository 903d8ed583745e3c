"""The processes of a deployment: start the server and sites (production kits or POC), find,
stop and terminate them; what was started is recorded in ``WS/cxrfl_processes.json``.

psutil is imported where needed (``cxrfl --help`` stays fast).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cxrfl.deploy.admin import admin_session, wait_ready
from cxrfl.deploy.workspace import DeployError, Deployment, is_loopback, nvflare_command, process_env, run_command

PROCESS_FILE = "cxrfl_processes.json"
CONSOLE_LOG = "cxrfl_console.log"


def _psutil():
    import psutil

    return psutil


def find_processes(workspace: str | Path) -> list[dict[str, Any]]:
    """Live NVFlare processes (servers, sites, job processes, ``sub_start.sh`` loops) of a workspace.

    A process counts when its command line names a path inside the workspace and it runs NVFlare
    (``nvflare`` in its command line or a kit's ``start.sh``/``sub_start.sh``). This process and
    its parents are never listed.

    Args:
        workspace: the deployment workspace.
    """
    psutil = _psutil()
    ws = str(Path(workspace).resolve())
    me = psutil.Process()
    skip = {me.pid, *(p.pid for p in me.parents())}
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.pid in skip or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if ws in cmd and ("nvflare" in cmd or "start.sh" in cmd):
            found.append({"pid": p.pid, "cmdline": cmd[:300]})
    return found


def _record(ws: Path, entries: list[dict[str, Any]]) -> None:
    path = ws / PROCESS_FILE
    old = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(old + entries, indent=2) + "\n")


def start(
    workspace: str | Path,
    only: list[str] | None = None,
    *,
    timeout: float = 180,
) -> dict[str, Any]:
    """Start the server and sites of a deployment and wait until the sites are connected.

    Production mode runs each kit's ``startup/sub_start.sh --once`` (NVFlare without its restart
    loop) in its own session, console output in ``<kit>/cxrfl_console.log``; POC mode runs
    ``nvflare poc start -p ...``. Started process ids go to ``WS/cxrfl_processes.json``.

    Args:
        workspace: the deployment workspace.
        only: participants to start (default: the server and every site); ``server`` names the server.
        timeout: seconds to wait for the server and the sites.
    """
    dep = Deployment.load(workspace)
    names = [dep.server if n == "server" else n for n in (only or [dep.server, *dep.clients])]
    unknown = [n for n in names if n not in (dep.server, *dep.clients)]
    if unknown:
        raise DeployError(
            f"cannot start {unknown}: not a server or site of this project ({[dep.server, *dep.clients]})"
        )
    clients = [n for n in names if n != dep.server]
    started: list[dict[str, Any]] = []
    offsets = {n: _size(dep.kit(n) / "log.txt") for n in clients}
    try:
        if dep.mode == "poc":
            _start_poc(dep, names, started, timeout)
        else:
            for n in ([dep.server] if dep.server in names else []) + clients:
                _start_kit(dep, n, started, timeout)
        deadline = time.monotonic() + timeout
        for n in clients:
            _wait_registered(dep.kit(n), n, offsets[n], deadline)
        ready = wait_ready(dep, clients, timeout=timeout)
    except BaseException:
        _kill_groups({int(e["pgid"]) for e in started})  # what this call started, not the rest of the federation
        raise
    return {"started": started, "ready": ready}


def _start_poc(dep: Deployment, names: list[str], started: list[dict[str, Any]], timeout: float) -> None:
    ws = dep.ws
    cmd = [nvflare_command(), "poc", "start", "--timeout", str(int(timeout))]
    for n in names:
        cmd += ["-p", n]
    log_path = ws / f"poc_start_{int(time.time())}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            env=process_env(ws, "cli", poc_workspace=ws / "poc"),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    entry = {"name": "nvflare poc start", "pid": proc.pid, "pgid": proc.pid, "log": str(log_path)}
    started.append(entry)
    _record(ws, [entry])
    try:
        rc = proc.wait(timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        rc = None
    if rc != 0:
        raise DeployError(f"nvflare poc start failed (exit {rc}); see {log_path}")


def _start_kit(dep: Deployment, name: str, started: list[dict[str, Any]], timeout: float) -> None:
    """``startup/sub_start.sh --once`` of one kit, in its own session (no restart loop)."""
    kit = dep.kit(name)
    log_path = kit / CONSOLE_LOG
    with open(log_path, "a") as log:
        proc = subprocess.Popen(
            ["bash", str(kit / "startup" / "sub_start.sh"), "--once"],
            cwd=kit,
            env=process_env(dep.ws, name),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    entry = {"name": name, "pid": proc.pid, "pgid": proc.pid, "log": str(log_path)}
    started.append(entry)
    _record(dep.ws, [entry])
    if name == dep.server:
        _wait_port("127.0.0.1" if is_loopback(dep.host) else dep.host, dep.port, timeout, proc, log_path)


def _kill_groups(groups: set[int], grace: float = 10) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_group_alive(g) for g in groups):
            time.sleep(0.5)


def _group_alive(pgid: int) -> bool:
    psutil = _psutil()
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                return True
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            continue
    return False


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _wait_registered(kit: Path, name: str, offset: int, deadline: float) -> None:
    """Wait for the site process just started to log its registration with the server.

    (The server's client list alone can still show an earlier login of the same site, e.g. by a
    ``nvflare preflight-check`` dry run.)
    """
    log = kit / "log.txt"
    needle = f"Successfully registered client:{name} "
    while time.monotonic() < deadline:
        if log.is_file():
            with open(log, "rb") as f:
                f.seek(offset if log.stat().st_size >= offset else 0)
                if needle.encode() in f.read():
                    return
        time.sleep(1)
    raise DeployError(f"site {name} did not register with the server in time; see {log}")


def _wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DeployError(f"the server exited (code {proc.returncode}) before listening; see {log}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise DeployError(f"the server did not listen on {host}:{port} within {timeout:.0f}s; see {log}")


def stop(workspace: str | Path, *, timeout: float = 120) -> dict[str, Any]:
    """Stop everything a workspace runs, gracefully first, and check that nothing is left.

    Aborts running jobs and shuts the system down through the project admin's FLARE API session
    (POC: ``nvflare poc stop --no-wait``), waits for the processes to end, then terminates what is left
    (process groups recorded at start and any NVFlare process naming the workspace).

    Args:
        workspace: the deployment workspace.
        timeout: seconds to wait for a graceful end.

    Returns:
        ``{"graceful": ..., "killed": [...], "left": [...]}``; ``left`` is empty on success.
    """
    dep = Deployment.load(workspace)
    ws = dep.ws
    graceful = ""
    try:
        sess = admin_session(dep, timeout=10)
        try:
            for job in sess.list_jobs():
                if job.get("status") in ("RUNNING", "SUBMITTED", "DISPATCHED", "APPROVED"):
                    # after a server crash NVFlare lists the job it ran as running but refuses to abort it
                    # ("not running"): that must not keep the system from its graceful shutdown
                    with contextlib.suppress(Exception):
                        sess.abort_job(job["job_id"])
        finally:
            sess.close()
        if dep.mode == "poc":  # --no-wait: NVFlare's own wait is a fixed 30 s (seen too short on a loaded
            # 2-core machine while the processes ended on their own soon after); the wait below has ``timeout``
            run_command(
                [nvflare_command(), "poc", "stop", "--no-wait"],
                process_env(ws, "cli", poc_workspace=ws / "poc"),
                "nvflare poc stop",
                timeout=timeout,
            )
        else:
            sess = admin_session(dep, timeout=10)
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    sess.shutdown("all", wait=True, timeout=min(timeout, 60))
            finally:
                try:
                    sess.close()
                except Exception:
                    pass
        graceful = "ok"
    except Exception as exc:
        graceful = f"{type(exc).__name__}: {exc}"
    deadline = time.monotonic() + timeout
    groups = _recorded_groups(ws)
    while _live(ws, groups) and time.monotonic() < deadline:
        time.sleep(1)
    killed = terminate(ws)
    left = [{"pid": pid, "cmdline": _cmdline(pid)} for pid in sorted(_live(ws, groups))]
    return {"graceful": graceful, "killed": killed, "left": left}


def terminate(workspace: str | Path, grace: float = 10) -> list[int]:
    """SIGTERM, then SIGKILL, the recorded process groups and every NVFlare process of the workspace.

    Args:
        workspace: the deployment workspace.
        grace: seconds each signal gets before the next.

    Returns:
        The process ids that had to be signalled.
    """
    ws = Path(workspace).resolve()
    groups = _recorded_groups(ws)
    signalled: set[int] = set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        targets = _live(ws, groups)
        if not targets:
            break
        for pid in targets:
            try:
                os.kill(pid, sig)
                signalled.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while _live(ws, groups) and time.monotonic() < deadline:
            time.sleep(0.5)
    return sorted(signalled)


def _recorded_groups(ws: Path) -> set[int]:
    path = ws / PROCESS_FILE
    if not path.is_file():
        return set()
    return {int(e["pgid"]) for e in json.loads(path.read_text()) if e.get("pgid")}


def _cmdline(pid: int) -> str:
    try:
        return " ".join(_psutil().Process(pid).cmdline())[:300]
    except Exception:
        return "?"


def _live(ws: Path, groups: set[int]) -> set[int]:
    """Live (non-zombie) processes of the workspace: by command line, or in a recorded process group."""
    psutil = _psutil()
    pids = {p["pid"] for p in find_processes(ws)}
    if groups:
        me = os.getpid()
        for p in psutil.process_iter(["pid", "status"]):
            try:
                if p.pid != me and p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) in groups:
                    pids.add(p.pid)
            except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                continue
    return pids
