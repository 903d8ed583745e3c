"""Real deployment: provision a federation, prepare its startup kits, start, submit, stop.

``cxrfl deploy ...`` wraps NVFlare 2.9's own tools (``nvflare provision``, ``nvflare poc``,
``startup/sub_start.sh``, the FLARE API) for the steps a project lead, a hospital's IT person and a
researcher do:

====================  =====================================================================
``provision``         kits for every participant of ``poc/project.yml`` (real certificates), in
                      production (``nvflare provision``) or POC mode (``nvflare poc prepare -i``),
                      then ``prepare-kit`` on each kit
``prepare-kit``       one kit's ``local/``: ``resources.json`` (job and snapshot storage moved out
                      of /tmp/nvflare, ``cxrfl.`` added to ``class_allow_list``) and
                      ``authorization.json`` (:data:`ORG_ADMIN_RIGHTS`)
``site-config``       a hospital's data config into its kit: ``local/cxrfl_site.yaml``
``job``               a job folder for deployment: ``preinstalled`` (no ``app/custom``) or
                      ``byoc`` (the package copied into ``app/custom``), optional privacy filters
``start`` / ``stop``  the server and sites of a workspace as background processes (no watchdog
                      loop in production mode; ``nvflare poc start/stop`` in POC mode); ``stop``
                      checks that every process is gone
``submit``            submit a job from an admin kit with the FLARE API, wait, download the result
====================  =====================================================================

A deployment workspace ``WS`` holds everything: ``WS/project.yml`` (the effective project file),
the kits (``WS/prod/<project>/prod_NN/<participant>`` or ``WS/poc/<project>/prod_00/...``),
``WS/home/<participant>`` and ``WS/tmp/<participant>`` (``HOME`` and ``TMPDIR`` of every process
started here, where NVFlare writes ``~/.nvflare``), ``WS/cxrfl_deploy.json`` (what was provisioned)
and ``WS/cxrfl_processes.json`` (what was started). Nothing is written outside ``WS``.

This module imports only the standard library and PyYAML at import time (``cxrfl --help`` stays
fast); NVFlare, psutil and the job definitions are imported where needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cxrfl.errors import ConfigError, CxrflError
from cxrfl.fl.site_config import LOCAL_CONFIG_NAME, SITE_CONFIG_DIR_ENV, SITE_CONFIG_ENV

STATE_FILE = "cxrfl_deploy.json"
PROCESS_FILE = "cxrfl_processes.json"
CONSOLE_LOG = "cxrfl_console.log"
ALLOW_PREFIXES = ("cxrfl.",)
ORG_ADMIN_RIGHTS = {"submit_job": "any", "byoc": "none"}
"""Changes to NVFlare's default policy for ``org_admin``: a hospital's org admin may submit jobs
(which then can only use code pre-installed on the sites) but never bring-your-own-code jobs."""
COMPLETED = "FINISHED:COMPLETED"
# site processes read their data config from local/; these would override it (see cxrfl.fl.site_config)
_SITE_ENV_OVERRIDES = (SITE_CONFIG_ENV, SITE_CONFIG_DIR_ENV)


class DeployError(CxrflError):
    """A deployment step failed; the message says which and what to do."""


# ---------------------------------------------------------------------------- workspace state
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
        return Path(self.workspace)

    def kit(self, name: str) -> Path:
        """The kit folder of a participant (``server`` is an alias of the server's name)."""
        name = self.server if name == "server" else name
        path = Path(self.kits) / name
        if not path.is_dir():
            raise DeployError(f"no kit for {name!r} in {self.kits}; participants: {[self.server, *self.clients, *self.admins]}")
        return path

    def admin_with_role(self, role: str) -> str:
        for name, r in self.admins.items():
            if r == role:
                return name
        raise DeployError(f"the project has no admin with role {role!r}")

    def save(self) -> None:
        (self.ws / STATE_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, workspace: str | Path) -> Deployment:
        path = Path(workspace).resolve() / STATE_FILE
        if not path.is_file():
            raise DeployError(f"{workspace} is not a deployment workspace (no {STATE_FILE}); run `cxrfl deploy provision` first")
        return cls(**json.loads(path.read_text()))


def _nvflare() -> str:
    exe = Path(sys.executable).with_name("nvflare")
    return str(exe) if exe.exists() else (shutil.which("nvflare") or "nvflare")


def process_env(workspace: Path, name: str, *, poc_workspace: Path | None = None) -> dict[str, str]:
    """Environment of an NVFlare command or process started for participant ``name``.

    ``HOME`` and ``TMPDIR`` point into the workspace (NVFlare writes ``~/.nvflare/config.conf``),
    the running Python's ``bin`` comes first on ``PATH`` (``sub_start.sh`` calls bare ``python3``),
    and ``CXRFL_SITE_CONFIG``/``CXRFL_SITE_CONFIG_DIR`` are removed so each site reads its own
    ``local/cxrfl_site.yaml``.
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


def _run(cmd: list[str], env: dict[str, str], what: str, timeout: float = 600, cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise DeployError(f"{what} did not finish within {timeout:.0f}s: {' '.join(cmd)}") from exc
    if proc.returncode != 0:
        raise DeployError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _is_loopback(host: str) -> bool:
    return host.rstrip(".").lower() == "localhost" or host.startswith("127.")


# ------------------------------------------------------------------------------- provisioning
def provision(
    project_file: str | Path,
    workspace: str | Path,
    *,
    poc: bool = False,
    server_host: str | None = None,
    port: int | None = None,
    org_admin_jobs: bool = True,
) -> Deployment:
    """Provision every participant of a project file into ``workspace`` and prepare the kits.

    Args:
        project_file: an NVFlare ``project.yml`` (api_version 3), e.g. ``poc/project.yml``.
        workspace: the deployment workspace (created; must not hold an earlier deployment).
        poc: POC mode (``nvflare poc prepare -i``) instead of production (``nvflare provision``).
        server_host: the host sites and admins connect to (the server's ``default_host``); with
            a loopback host the server also listens on loopback only.
        port: the server's port (``fed_learn_port``; FL and admin traffic share it).
        org_admin_jobs: let org admins submit jobs that use pre-installed code (:data:`ORG_ADMIN_RIGHTS`).
    """
    ws = Path(workspace).resolve()
    if (ws / STATE_FILE).exists():
        raise DeployError(f"{ws} already holds a deployment; stop it and use a new workspace")
    ws.mkdir(parents=True, exist_ok=True)
    project = yaml.safe_load(Path(project_file).read_text())
    if not isinstance(project, dict) or "participants" not in project:
        raise ConfigError(f"{project_file} is not an NVFlare project file (no participants)")
    servers = [p for p in project["participants"] if p.get("type") == "server"]
    if len(servers) != 1:
        raise ConfigError(f"{project_file} must name exactly one server, found {len(servers)}")
    srv = servers[0]
    if server_host:
        srv["default_host"] = server_host
    if poc:
        srv["default_host"] = "localhost"
    if port:
        srv["fed_learn_port"] = int(port)
        if "admin_port" in srv:
            srv["admin_port"] = int(port)
    effective = ws / "project.yml"
    effective.write_text(yaml.safe_dump(project, sort_keys=False))
    name = str(project["name"])

    if poc:
        poc_ws = ws / "poc"
        env = process_env(ws, "cli", poc_workspace=poc_ws)
        _run([_nvflare(), "poc", "prepare", "-i", str(effective), "--force"], env, "nvflare poc prepare")
        kits = poc_ws / name / "prod_00"
    else:
        env = process_env(ws, "cli")
        _run([_nvflare(), "provision", "-p", str(effective), "-w", str(ws / "prod")], env, "nvflare provision")
        prods = sorted((ws / "prod" / name).glob("prod_*"))
        if not prods:
            raise DeployError(f"nvflare provision wrote no kits under {ws / 'prod' / name}")
        kits = prods[-1]

    host = srv.get("default_host") or srv["name"]
    dep = Deployment(
        workspace=str(ws),
        mode="poc" if poc else "prod",
        project=name,
        kits=str(kits),
        server=srv["name"],
        clients=[p["name"] for p in project["participants"] if p.get("type") == "client"],
        admins={p["name"]: p.get("role", "") for p in project["participants"] if p.get("type") == "admin"},
        host=host,
        port=int(srv.get("fed_learn_port", 8002)),
        orgs={p["name"]: p.get("org", "") for p in project["participants"]},
    )
    if _is_loopback(host):
        _listen_on_loopback(dep.kit(dep.server))
    for participant in [dep.server, *dep.clients]:
        prepare_kit(dep.kit(participant), storage=ws / "storage" if participant == dep.server else None,
                    org_admin_jobs=org_admin_jobs)
    dep.save()
    return dep


def _listen_on_loopback(server_kit: Path) -> None:
    """Make the server bind 127.0.0.1 only (its target host becomes ``localhost``)."""
    path = server_kit / "startup" / "fed_server.json"
    cfg = json.loads(path.read_text())
    for s in cfg.get("servers", []):
        target = s.get("service", {}).get("target", "")
        if ":" in target:
            s["service"]["target"] = "localhost:" + target.rsplit(":", 1)[1]
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def kit_kind(kit: Path) -> str:
    """``server``, ``client`` or ``admin`` from the kit's startup files."""
    startup = Path(kit) / "startup"
    for kind, marker in (("server", "fed_server.json"), ("client", "fed_client.json"), ("admin", "fed_admin.json")):
        if (startup / marker).is_file():
            return kind
    raise DeployError(f"{kit} is not an NVFlare startup kit (no startup/fed_server.json, fed_client.json or fed_admin.json)")


def _load_local(kit: Path, name: str) -> dict[str, Any]:
    for candidate in (kit / "local" / name, kit / "local" / f"{name}.default"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise DeployError(f"{kit}/local has neither {name} nor {name}.default; is this a provisioned kit?")


def prepare_kit(
    kit: str | Path,
    *,
    storage: str | Path | None = None,
    allow: tuple[str, ...] = ALLOW_PREFIXES,
    org_admin_jobs: bool = True,
) -> dict[str, Any]:
    """Write a server or site kit's ``local/resources.json`` and ``local/authorization.json``.

    - ``class_allow_list``: NVFlare's list (the kit's, or the built-in default) plus ``allow``
      (``cxrfl.``), so jobs without ``app/custom`` may use the pre-installed package;
    - server only: job and snapshot storage under ``storage`` (default ``<kit>/storage``)
      instead of /tmp/nvflare;
    - authorization: NVFlare's default policy with :data:`ORG_ADMIN_RIGHTS` for ``org_admin``
      (``org_admin_jobs=False`` keeps NVFlare's default: org admins submit nothing).

    Args:
        kit: the kit folder.
        storage: server job/snapshot storage folder.
        allow: class-path prefixes to allow (each ending in ``.``) or full class paths.
        org_admin_jobs: see above.

    Returns:
        What was written (paths and settings).
    """
    kit = Path(kit).resolve()
    kind = kit_kind(kit)
    if kind == "admin":
        return {"kit": str(kit), "kind": kind, "written": []}
    res = _load_local(kit, "resources.json")
    allow_list = res.get("class_allow_list")
    if allow_list is None:
        from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

        allow_list = list(DEFAULT_CLASS_ALLOW_LIST)
    for prefix in allow:
        if prefix not in allow_list:
            allow_list.append(prefix)
    res["class_allow_list"] = allow_list
    res.setdefault("class_list_enforcement_mode", "enforce")
    out: dict[str, Any] = {"kit": str(kit), "kind": kind, "class_allow_list_added": list(allow)}
    if kind == "server":
        root = Path(storage).resolve() if storage else kit / "storage"
        jobs, snapshots = root / "jobs-storage", root / "snapshot-storage"
        jobs.mkdir(parents=True, exist_ok=True)
        snapshots.mkdir(parents=True, exist_ok=True)
        try:
            res["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"] = str(snapshots)
        except (KeyError, TypeError) as exc:
            raise DeployError(f"{kit}/local/resources.json has no snapshot_persistor storage to move") from exc
        managers = [c for c in res.get("components", []) if c.get("id") == "job_manager"]
        if not managers:
            raise DeployError(f"{kit}/local/resources.json has no job_manager component")
        for comp in managers:
            comp.setdefault("args", {})["uri_root"] = str(jobs)
        out.update(jobs_storage=str(jobs), snapshot_storage=str(snapshots))
    leftover = [s for s in _strings(res) if s.startswith("/tmp/nvflare")]
    if leftover:
        raise DeployError(f"{kit}/local/resources.json still points at {leftover}; edit it by hand")
    (kit / "local" / "resources.json").write_text(json.dumps(res, indent=2) + "\n")

    policy = _load_local(kit, "authorization.json")
    org_admin = policy.setdefault("permissions", {}).setdefault("org_admin", {})
    if isinstance(org_admin, dict):
        if org_admin_jobs:
            org_admin.update(ORG_ADMIN_RIGHTS)
        org_admin["byoc"] = "none"
    (kit / "local" / "authorization.json").write_text(json.dumps(policy, indent=2) + "\n")
    out["written"] = [str(kit / "local" / "resources.json"), str(kit / "local" / "authorization.json")]
    out["org_admin"] = org_admin
    return out


def _strings(obj: Any):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def kit_participant(kit: Path) -> str:
    """The participant name of a site kit (``fqsn`` in ``fed_client.json``), else the folder name."""
    path = Path(kit) / "startup" / "fed_client.json"
    if path.is_file():
        name = json.loads(path.read_text()).get("client", {}).get("fqsn")
        if name:
            return str(name)
    return Path(kit).name


def install_site_config(kit: str | Path, config: str | Path) -> Path:
    """Validate a site's data config and write it to ``<kit>/local/cxrfl_site.yaml``.

    Relative paths are made absolute (against the config's folder) so the copy works from the
    kit. The config's ``site`` must be the kit's participant name.

    Args:
        kit: the site's kit folder.
        config: the site config YAML (see ``site_configs/README.md``).
    """
    from cxrfl.data.site_config import load_site_config

    kit = Path(kit).resolve()
    if kit_kind(kit) != "client":
        raise DeployError(f"{kit} is not a site (client) kit")
    cfg = load_site_config(config)
    name = kit_participant(kit)
    if cfg.site != name:
        raise DeployError(f"{config} describes site {cfg.site!r} but the kit {kit} is {name!r}")
    target = kit / "local" / LOCAL_CONFIG_NAME
    header = f"# {name}'s data, read by cxrfl at job start (written by `cxrfl deploy site-config` from {Path(config).resolve()})\n"
    target.write_text(header + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return target


# ----------------------------------------------------------------------------------- jobs
def build_job(
    name: str,
    out: str | Path,
    *,
    mode: str = "preinstalled",
    overrides: dict[str, Any] | None = None,
    privacy: dict[str, Any] | None = None,
    exclude_batchnorm: bool = False,
    job_name: str | None = None,
) -> Path:
    """Write a deployable job folder from a job in :data:`cxrfl.jobs.JOBS`.

    Args:
        name: the job (``surgical_agg``, ...).
        out: parent folder; the job is written to ``out/<job_name or name>`` (must not exist).
        mode: ``preinstalled`` (no ``app/custom``), ``byoc`` (package in ``app/custom``) or
            ``readme`` (as committed under ``jobs/``).
        overrides: controller arguments to change, dotted for nested ones
            (``{"num_rounds": 2, "train_config.batch_size": 16}``).
        privacy: ``{"method": "percentile" | "svt", "args": {...}}`` (see :class:`cxrfl.jobs.JobSpec`).
        exclude_batchnorm: add the ExcludeVars filter of every BatchNorm entry (FedBN/FedBN+).
        job_name: another name for the job (folder and meta).
    """
    import copy
    import dataclasses

    from cxrfl.jobs import JOBS, write_job

    specs = {s.name: s for s in JOBS}
    if name not in specs:
        raise DeployError(f"unknown job {name!r}; jobs: {sorted(specs)}")
    modes = {"preinstalled": "none", "byoc": "package", "readme": "readme"}
    if mode not in modes:
        raise DeployError(f"mode must be one of {sorted(modes)}, got {mode!r}")
    spec = specs[name]
    args = copy.deepcopy(spec.controller_args)
    for key, value in (overrides or {}).items():
        node = args
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise DeployError(f"cannot set {key!r}: {part!r} is not a group of settings")
            node = node[part]
        if parts[-1] not in node:
            raise DeployError(f"unknown setting {key!r} of job {name}; known: {sorted(node)}")
        node[parts[-1]] = value
    # meta.json's min_clients (sites needed to schedule the job) follows an explicit min_clients override
    meta_min = int(overrides["min_clients"]) if "min_clients" in (overrides or {}) else spec.min_clients
    try:
        spec = dataclasses.replace(spec, name=job_name or spec.name, controller_args=args, privacy=privacy,
                                   exclude_batchnorm=exclude_batchnorm, min_clients=meta_min)
    except ValueError as exc:
        raise DeployError(str(exc)) from exc
    out = Path(out)
    if (out / spec.name).exists():
        raise DeployError(f"{out / spec.name} exists; choose another --out")
    return write_job(spec, out, custom=modes[mode])


# ------------------------------------------------------------------------------- processes
def _psutil():
    import psutil

    return psutil


def find_processes(workspace: str | Path) -> list[dict[str, Any]]:
    """Live NVFlare processes (servers, sites, job processes, ``sub_start.sh`` loops) of a workspace.

    A process counts when its command line names a path inside the workspace and it runs NVFlare
    (``nvflare`` in its command line or a kit's ``start.sh``/``sub_start.sh``). This process and
    its parents are never listed.
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
    ws = dep.ws
    names = [dep.server if n == "server" else n for n in (only or [dep.server, *dep.clients])]
    unknown = [n for n in names if n not in (dep.server, *dep.clients)]
    if unknown:
        raise DeployError(f"cannot start {unknown}: not a server or site of this project ({[dep.server, *dep.clients]})")
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
    cmd = [_nvflare(), "poc", "start", "--timeout", str(int(timeout))]
    for n in names:
        cmd += ["-p", n]
    log_path = ws / f"poc_start_{int(time.time())}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=process_env(ws, "cli", poc_workspace=ws / "poc"), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
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
            ["bash", str(kit / "startup" / "sub_start.sh"), "--once"], cwd=kit, env=process_env(dep.ws, name),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    entry = {"name": name, "pid": proc.pid, "pgid": proc.pid, "log": str(log_path)}
    started.append(entry)
    _record(dep.ws, [entry])
    if name == dep.server:
        _wait_port("127.0.0.1" if _is_loopback(dep.host) else dep.host, dep.port, timeout, proc, log_path)


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


def admin_session(dep: Deployment, admin: str | None = None, *, timeout: float = 30):
    """A FLARE API session from an admin kit of the deployment (default: the project admin)."""
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    admin = admin or dep.admin_with_role("project_admin")
    with contextlib.redirect_stdout(sys.stderr):  # NVFlare prints "Connecting to FLARE ..."
        return new_secure_session(admin, str(dep.kit(admin)), timeout=timeout)


def wait_ready(dep: Deployment, clients: list[str], *, timeout: float = 180) -> dict[str, Any]:
    """Wait until the server answers the project admin and lists every site in ``clients``."""
    deadline = time.monotonic() + timeout
    last = ""
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
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(2)
    raise DeployError(f"the federation was not ready within {timeout:.0f}s (waiting for {clients}; {last})")


def stop(workspace: str | Path, *, timeout: float = 120) -> dict[str, Any]:
    """Stop everything a workspace runs, gracefully first, and check that nothing is left.

    Aborts running jobs and shuts the system down through the project admin's FLARE API session
    (POC: ``nvflare poc stop``), waits for the processes to end, then terminates what is left
    (process groups recorded at start and any NVFlare process naming the workspace).

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
                    sess.abort_job(job["job_id"])
        finally:
            sess.close()
        if dep.mode == "poc":
            _run([_nvflare(), "poc", "stop"], process_env(ws, "cli", poc_workspace=ws / "poc"), "nvflare poc stop",
                 timeout=timeout)
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


# -------------------------------------------------------------------------------- submitting
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
        ``job_id``, ``status``, ``refused`` (why NVFlare did not run it, if so) and ``result``.
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
    out: dict[str, Any] = {"job": str(job), "admin": admin, "bring_your_own_code": (job / "app" / "custom").is_dir()}
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
        except Exception as exc:  # JobTimeout, lost connection: the job may still be running
            out.update(status="WAIT_FAILED", error=f"{type(exc).__name__}: {exc}")
            return out
        out["status"] = meta.get("status")
        detail = meta.get("job_deploy_detail")
        if out["status"] != COMPLETED and detail:
            out["refused"] = "; ".join(str(d) for d in detail) if isinstance(detail, list) else str(detail)
        if download and out["status"] == COMPLETED:
            out["result"] = sess.download_job_result(job_id, destination=str(Path(download).resolve()))
    finally:
        sess.close()
    return out


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
            out.update(status=str(sess.get_job_meta(job_id).get("status")),
                       note=f"the server runs no such job ({exc}); nothing to abort. A job interrupted by a server "
                            f"restart stays listed as running in NVFlare 2.9; resume it with resume_from={job_id!r}")
            return out
        try:
            meta = sess.wait_for_job(job_id, timeout=timeout, poll_interval=2)
            out["status"] = meta.get("status")
        except Exception as exc:  # JobTimeout, lost connection
            out.update(status="WAIT_FAILED", error=f"{type(exc).__name__}: {exc}")
            return out
        if download:
            out["result"] = sess.download_job_result(job_id, destination=str(Path(download).resolve()))
    finally:
        sess.close()
    return out


# ---------------------------------------------------------------------------------------- CLI
def _kv(items: list[str] | None) -> dict[str, Any]:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise DeployError(f"expected KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


_STDOUT = None  # the real stdout while a command runs (NVFlare's own prints go to stderr)


def _quiet(fn):
    def run(args: argparse.Namespace) -> int:
        global _STDOUT
        _STDOUT = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            return fn(args)

    run.__doc__ = fn.__doc__
    return run


def _emit(text: str) -> None:
    print(text, file=_STDOUT or sys.stdout, flush=True)


def _print(obj: Any) -> None:
    _emit(json.dumps(obj, indent=2, default=str))


def _kit_arg(args: argparse.Namespace, name: str) -> Path:
    if args.workspace:
        return Deployment.load(args.workspace).kit(name)
    return Path(name)


def _cmd_provision(args: argparse.Namespace) -> int:
    dep = provision(args.project, args.workspace, poc=args.poc, server_host=args.server_host, port=args.port,
                    org_admin_jobs=not args.no_org_admin_jobs)
    _print(asdict(dep))
    print(f"kits in {dep.kits}; next: cxrfl deploy site-config --workspace {args.workspace} SITE CONFIG.yaml", file=sys.stderr)
    return 0


def _cmd_prepare_kit(args: argparse.Namespace) -> int:
    _print(prepare_kit(_kit_arg(args, args.kit), storage=args.storage, allow=tuple(args.allow or ALLOW_PREFIXES),
                       org_admin_jobs=not args.no_org_admin_jobs))
    return 0


def _cmd_site_config(args: argparse.Namespace) -> int:
    _emit(str(install_site_config(_kit_arg(args, args.kit), args.config)))
    return 0


def _cmd_job(args: argparse.Namespace) -> int:
    privacy = None
    if args.privacy:
        privacy = {"method": args.privacy, "args": _kv(args.privacy_arg)}
    elif args.privacy_arg:
        raise DeployError("--privacy-arg needs --privacy")
    _emit(str(build_job(args.name, args.out, mode=args.mode, overrides=_kv(args.set), privacy=privacy,
                        exclude_batchnorm=args.exclude_batchnorm, job_name=args.job_name)))
    return 0


def _cmd_start(args: argparse.Namespace) -> int:
    _print(start(args.workspace, args.only, timeout=args.timeout))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    dep = Deployment.load(args.workspace)
    status: dict[str, Any] = {"processes": find_processes(dep.ws)}
    try:
        sess = admin_session(dep, timeout=5)
        try:
            info = sess.get_system_info()
            status["server"] = str(info.server_info)
            status["clients"] = sorted(c.name for c in info.client_info)
            status["jobs"] = sess.list_jobs()
        finally:
            sess.close()
    except Exception as exc:
        status["server"] = f"not reachable: {type(exc).__name__}: {exc}"
    _print(status)
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    result = submit(args.job, workspace=args.workspace, admin=args.admin, kit=args.kit, wait=not args.no_wait,
                    timeout=args.timeout, download=args.download)
    _print(result)
    if result.get("refused"):
        print(f"cxrfl: job refused for {result['admin']}: {result['refused']}", file=sys.stderr)
        return 1
    return 0 if result.get("status") in (COMPLETED, "SUBMITTED") else 1


def _cmd_abort(args: argparse.Namespace) -> int:
    result = abort(args.job_id, workspace=args.workspace, admin=args.admin, timeout=args.timeout, download=args.download)
    _print(result)
    return 0 if str(result.get("status", "")).startswith("FINISHED") else 1


def _cmd_stop(args: argparse.Namespace) -> int:
    result = stop(args.workspace, timeout=args.timeout)
    _print(result)
    return 0 if not result["left"] else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``deploy`` command group to the ``cxrfl`` parser."""
    d = sub.add_parser("deploy", help="real deployment: provision, prepare kits, start, submit, stop")
    ds = d.add_subparsers(dest="deploy_command", required=True)

    p = ds.add_parser("provision", help="provision every participant of a project.yml into a workspace")
    p.add_argument("--project", default="poc/project.yml", help="NVFlare project file (default poc/project.yml)")
    p.add_argument("--workspace", required=True, help="deployment workspace (everything is written under it)")
    p.add_argument("--poc", action="store_true", help="POC mode (nvflare poc prepare -i) instead of production")
    p.add_argument("--server-host", help="host the sites connect to (e.g. localhost for one machine)")
    p.add_argument("--port", type=int, help="the server's port (FL and admin traffic)")
    p.add_argument("--no-org-admin-jobs", action="store_true", help="keep NVFlare's default: org admins submit no jobs")
    p.set_defaults(func=_quiet(_cmd_provision))

    p = ds.add_parser("prepare-kit", help="a kit's local/resources.json (storage, class_allow_list) and authorization.json")
    p.add_argument("kit", help="kit folder, or a participant name with --workspace")
    p.add_argument("--workspace")
    p.add_argument("--storage", help="server job and snapshot storage folder (default <kit>/storage)")
    p.add_argument("--allow", action="append", help="class-path prefix to allow (default: cxrfl.)")
    p.add_argument("--no-org-admin-jobs", action="store_true")
    p.set_defaults(func=_quiet(_cmd_prepare_kit))

    p = ds.add_parser("site-config", help="put a site's data config into its kit (local/cxrfl_site.yaml)")
    p.add_argument("kit", help="the site's kit folder, or its name with --workspace")
    p.add_argument("config", help="the site config YAML (site_configs/README.md)")
    p.add_argument("--workspace")
    p.set_defaults(func=_quiet(_cmd_site_config))

    p = ds.add_parser("job", help="write a deployable job folder (pre-installed or bring-your-own-code)")
    p.add_argument("name", help="a job of cxrfl.jobs.JOBS: the folder names under jobs/ (surgical_agg, ...)")
    p.add_argument("--out", required=True, help="parent folder of the job folder")
    p.add_argument("--mode", choices=["preinstalled", "byoc", "readme"], default="preinstalled",
                   help="preinstalled: no app/custom (sites allow cxrfl.); byoc: package in app/custom")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="change a controller setting, e.g. num_rounds=2 or train_config.batch_size=16 (JSON values)")
    p.add_argument("--privacy", choices=["percentile", "svt"], help="NVFlare privacy filter on site results")
    p.add_argument("--privacy-arg", action="append", metavar="KEY=VALUE", help="its arguments, e.g. gamma=0.05")
    p.add_argument("--exclude-batchnorm", action="store_true", help="ExcludeVars filter of BatchNorm entries (FedBN/FedBN+)")
    p.add_argument("--job-name", help="another job (folder) name")
    p.set_defaults(func=_quiet(_cmd_job))

    p = ds.add_parser("start", help="start the server and sites of a workspace in the background")
    p.add_argument("--workspace", required=True)
    p.add_argument("--only", nargs="+", help="participants to start (default: server and every site)")
    p.add_argument("--timeout", type=float, default=180)
    p.set_defaults(func=_quiet(_cmd_start))

    p = ds.add_parser("status", help="processes, connected sites and jobs of a workspace")
    p.add_argument("--workspace", required=True)
    p.set_defaults(func=_quiet(_cmd_status))

    p = ds.add_parser("submit", help="submit a job from an admin kit (FLARE API), wait, download")
    p.add_argument("job", help="job folder")
    p.add_argument("--workspace", help="deployment workspace (with --admin)")
    p.add_argument("--admin", help="admin name (default: the project admin / the kit's user)")
    p.add_argument("--kit", help="an admin kit folder instead of --workspace")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--download", help="download the result into this folder")
    p.set_defaults(func=_quiet(_cmd_submit))

    p = ds.add_parser("abort", help="abort a running job (its completed rounds stay usable), optionally download it")
    p.add_argument("job_id")
    p.add_argument("--workspace", required=True)
    p.add_argument("--admin", help="admin name (default: the project admin)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--download", help="download the result into this folder")
    p.set_defaults(func=_quiet(_cmd_abort))

    p = ds.add_parser("stop", help="stop everything a workspace runs and check that nothing is left")
    p.add_argument("--workspace", required=True)
    p.add_argument("--timeout", type=float, default=120)
    p.set_defaults(func=_quiet(_cmd_stop))
