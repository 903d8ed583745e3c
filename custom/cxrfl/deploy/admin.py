"""The admin side: FLARE API sessions from an admin kit, waiting for the federation, submitting
and aborting jobs (and downloading their results)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from cxrfl.deploy.workspace import DeployError, Deployment
from cxrfl.job_folders import app_dirs

COMPLETED = "FINISHED:COMPLETED"
UNSCHEDULED = ("SUBMITTED", "FINISHED:CAN_NOT_SCHEDULE")
"""Job states of a job NVFlare's scheduler has not (or never) dispatched."""


def admin_session(dep: Deployment, admin: str | None = None, *, timeout: float = 30):
    """A FLARE API session from an admin kit of the deployment.

    Args:
        dep: the deployment.
        admin: the admin's name (default: the project admin).
        timeout: seconds to connect.
    """
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    admin = admin or dep.admin_with_role("project_admin")
    with contextlib.redirect_stdout(sys.stderr):  # NVFlare prints "Connecting to FLARE ..."
        return new_secure_session(admin, str(dep.kit(admin)), timeout=timeout)


def wait_ready(dep: Deployment, clients: list[str], *, timeout: float = 180) -> dict[str, Any]:
    """Wait until the server answers the project admin and lists every site in ``clients``.

    Args:
        dep: the deployment.
        clients: the sites that must be connected.
        timeout: seconds to wait.
    """
    deadline = time.monotonic() + timeout
    last, last_exc = "", None
    while time.monotonic() < deadline:
        try:
            sess = admin_session(dep, timeout=10)
            try:
                info = sess.get_system_info()
                connected = sorted(c.name for c in info.client_info)
            finally:
                sess.close()
            if set(clients) <= set(connected):
                return {"server": dep.server, "clients": connected}
            last = f"connected sites: {connected}"
        except Exception as exc:  # server not up yet
            last, last_exc = f"{type(exc).__name__}: {exc}", exc
        time.sleep(2)
    message = f"the federation was not ready within {timeout:.0f}s (waiting for {clients}; {last})"
    raise DeployError(message) from last_exc


def submit(
    job: str | Path,
    *,
    workspace: str | Path | None = None,
    admin: str | None = None,
    kit: str | Path | None = None,
    wait: bool = True,
    timeout: float = 1800,
    download: str | Path | None = None,
) -> dict[str, Any]:
    """Submit a job folder from an admin kit with the FLARE API; optionally wait and download.

    Args:
        job: the job folder.
        workspace: a deployment workspace (the admin kit is found by ``admin``), or
        kit: an admin kit folder (``admin`` defaults to the kit's user).
        admin: the admin's name (e.g. ``lead@cxrfl.example``).
        wait: wait until the job ends.
        timeout: seconds to wait.
        download: folder to download the job's result into (after it ends).

    Returns:
        ``job_id``, ``status``, ``refused`` (why NVFlare did not run it, if so), ``not_scheduled``
        and ``resource_spec`` (why NVFlare's scheduler has not dispatched it, e.g. too few sites offer
        the resources it asks for, and what it asks: :func:`not_scheduled`), ``result`` and
        ``download_refused`` (why the download was refused: org admins download no results,
        docs/security.md).
    """
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    if kit is None:
        if workspace is None:
            raise DeployError("give --workspace (and --admin) or --kit")
        dep = Deployment.load(workspace)
        admin = admin or dep.admin_with_role("project_admin")
        kit = dep.kit(admin)
    kit = Path(kit).resolve()
    if admin is None:
        admin = json.loads((kit / "startup" / "fed_admin.json").read_text())["admin"]["username"]
    job = Path(job).resolve()
    if not (job / "meta.json").is_file():
        raise DeployError(f"{job} is not a job folder (no meta.json)")
    out: dict[str, Any] = {
        "job": str(job),
        "admin": admin,
        "bring_your_own_code": any((app / "custom").is_dir() for app in app_dirs(job)),
    }
    with contextlib.redirect_stdout(sys.stderr):
        sess = new_secure_session(admin, str(kit), timeout=30)
    try:
        try:
            out["job_id"] = job_id = sess.submit_job(str(job))
        except Exception as exc:
            out.update(status="REFUSED_AT_SUBMISSION", refused=f"{type(exc).__name__}: {exc}")
            return out
        if not wait:
            out["status"] = "SUBMITTED"
            return out
        try:
            meta = sess.wait_for_job(job_id, timeout=timeout, poll_interval=3)
        except Exception as exc:  # JobTimeout, lost connection: the job may still be running (or waiting)
            out.update(status="WAIT_FAILED", error=f"{type(exc).__name__}: {exc}", **not_scheduled(sess, job_id))
            return out
        out["status"] = meta.get("status")
        detail = meta.get("job_deploy_detail")
        if out["status"] != COMPLETED and detail:
            out["refused"] = "; ".join(str(d) for d in detail) if isinstance(detail, list) else str(detail)
        out.update(not_scheduled(sess, job_id, meta))
        if download and out["status"] == COMPLETED:
            out.update(_download(sess, job_id, download))
    finally:
        sess.close()
    return out


def not_scheduled(sess: Any, job_id: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Why NVFlare's scheduler has not dispatched a job, from its ``schedule_history``; {} once it has.

    Args:
        sess: a FLARE API session.
        job_id: the job.
        meta: the job's meta if already fetched.

    Returns:
        ``not_scheduled`` (NVFlare's distinct reasons, oldest first) and ``resource_spec`` (what the
        job asks of each site), or {} (the job was dispatched, or its meta cannot be read).
    """
    try:
        meta = meta if meta is not None else sess.get_job_meta(job_id)
    except Exception:  # lost connection: nothing more to say than the caller's error
        return {}
    if meta.get("status") not in UNSCHEDULED:
        return {}
    reasons = [str(h).split(": ", 1)[-1] for h in meta.get("schedule_history") or []]
    reasons = list(dict.fromkeys(r for r in reasons if r != "scheduled"))
    if not reasons:
        return {}
    return {"not_scheduled": "; ".join(reasons), "resource_spec": meta.get("resource_spec") or {}}


def _download(sess: Any, job_id: str, destination: str | Path) -> dict[str, str]:
    """``{"result": folder}``, or ``{"download_refused": why}`` when NVFlare's authorization refuses it."""
    try:
        return {"result": sess.download_job_result(job_id, destination=str(Path(destination).resolve()))}
    except Exception as exc:  # NVFlare raises on NOT_AUTHORIZED; anything else is reported the same way
        return {"download_refused": f"{type(exc).__name__}: {exc}"}


def download(
    job_id: str, *, workspace: str | Path, admin: str | None = None, destination: str | Path
) -> dict[str, Any]:
    """Download a finished job's result from an admin kit (the project admin may download every job).

    Args:
        job_id: the job.
        workspace: the deployment workspace.
        admin: the admin's name (default: the project admin).
        destination: folder to download into.

    Returns:
        ``job_id``, ``admin`` and ``result`` (the downloaded folder) or ``download_refused``.
    """
    dep = Deployment.load(workspace)
    admin = admin or dep.admin_with_role("project_admin")
    sess = admin_session(dep, admin)
    try:
        return {"job_id": job_id, "admin": admin, **_download(sess, job_id, destination)}
    finally:
        sess.close()


def abort(
    job_id: str,
    *,
    workspace: str | Path,
    admin: str | None = None,
    timeout: float = 300,
    download: str | Path | None = None,
) -> dict[str, Any]:
    """Abort a running job from an admin kit, wait until it has ended, optionally download its result.

    The server keeps every completed round (``cxrfl/checkpoints/round_NNN.pt`` in the result,
    usable by ``cxrfl predict``) and what a later job needs to continue the run
    (``resume_from=<job id>``).

    Args:
        job_id: the job to abort.
        workspace: the deployment workspace.
        admin: the admin's name (default: the project admin).
        timeout: seconds to wait for the job to end.
        download: folder to download the job's result into.

    Returns:
        ``job_id``, ``status`` and ``result`` (the downloaded folder, if any).
    """
    dep = Deployment.load(workspace)
    sess = admin_session(dep, admin)
    out: dict[str, Any] = {"job_id": job_id}
    try:
        try:
            sess.abort_job(job_id)
        except Exception as exc:  # e.g. a job a server restart interrupted: NVFlare still lists it
            if "not running" not in str(exc):
                raise
            out.update(
                status=str(sess.get_job_meta(job_id).get("status")),
                note=f"the server runs no such job ({exc}); nothing to abort. A job interrupted by a server "
                f"restart stays listed as running in NVFlare 2.9; resume it with resume_from={job_id!r}",
            )
            return out
        try:
            meta = sess.wait_for_job(job_id, timeout=timeout, poll_interval=2)
            out["status"] = meta.get("status")
        except Exception as exc:  # JobTimeout, lost connection
            out.update(status="WAIT_FAILED", error=f"{type(exc).__name__}: {exc}")
            return out
        if download:
            out.update(_download(sess, job_id, download))
    finally:
        sess.close()
    return out
