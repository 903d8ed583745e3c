"""Provisioning: kits for every participant of a project file, each kit's local resources and
authorization, and a hospital's data config in its kit.

``provision`` wraps ``nvflare provision`` (production) or ``nvflare poc prepare -i`` (POC), then
``prepare_kit`` writes each server and site kit's ``local/resources.json`` (job and snapshot
storage moved out of /tmp/nvflare, ``cxrfl.`` added to ``class_allow_list``) and
``local/authorization.json`` (:data:`ORG_ADMIN_RIGHTS`); ``declare_gpus`` the GPUs a site offers jobs
(:mod:`cxrfl.fl.resources`); ``protect_keys`` leaves every private key and the provisioning state (root
CA key) readable by their owner only. The policy: docs/security.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from cxrfl.deploy.workspace import (
    STATE_FILE,
    DeployError,
    Deployment,
    is_loopback,
    nvflare_command,
    process_env,
    run_command,
)
from cxrfl.errors import ConfigError
from cxrfl.fl.site_config import LOCAL_CONFIG_NAME

ALLOW_PREFIXES = ("cxrfl.",)
ORG_ADMIN_ALWAYS = {"download_job": "none", "clone_job": "none", "byoc": "none"}
"""Changes to NVFlare's default policy for ``org_admin``, always: a hospital's org admin never
downloads a job's results (the server's records name every site's classes), clones no job and
brings no code."""
ORG_ADMIN_RIGHTS = {**ORG_ADMIN_ALWAYS, "submit_job": "any"}
"""With ``org_admin_jobs`` (the default): an org admin may also submit jobs, which can then use
only code pre-installed on the sites; the server refuses those whose mode sends class names to
every site (:data:`cxrfl.fl.base.CLASS_NAME_ROLES`)."""
OWNER_ONLY_FILE, OWNER_ONLY_DIR = 0o600, 0o700
GPU_MANAGER = "nvflare.app_common.resource_managers.list_resource_manager.ListResourceManager"
GPU_CONSUMER = "cxrfl.fl.resources.GPUListConsumer"
"""A site's declared GPUs: NVFlare's list manager (one job per GPU index) and the consumer that pins a job to its
own."""


def _effective_project(
    project_file: str | Path, effective: Path, *, poc: bool, server_host: str | None, port: int | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The project file with the server's host and port set, written to ``effective``; (project, server entry)."""
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
    effective.write_text(yaml.safe_dump(project, sort_keys=False))
    return project, srv


def _make_kits(ws: Path, effective: Path, name: str, poc: bool) -> Path:
    """Run NVFlare's provisioning; the folder holding one kit per participant."""
    if poc:
        poc_ws = ws / "poc"
        env = process_env(ws, "cli", poc_workspace=poc_ws)
        run_command([nvflare_command(), "poc", "prepare", "-i", str(effective), "--force"], env, "nvflare poc prepare")
        return poc_ws / name / "prod_00"
    env = process_env(ws, "cli")
    run_command(
        [nvflare_command(), "provision", "-p", str(effective), "-w", str(ws / "prod")], env, "nvflare provision"
    )
    prods = sorted((ws / "prod" / name).glob("prod_*"))
    if not prods:
        raise DeployError(f"nvflare provision wrote no kits under {ws / 'prod' / name}")
    return prods[-1]


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
    project, srv = _effective_project(project_file, ws / "project.yml", poc=poc, server_host=server_host, port=port)
    name = str(project["name"])
    kits = _make_kits(ws, ws / "project.yml", name, poc)
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
    if is_loopback(host):
        _listen_on_loopback(dep.kit(dep.server))
    for participant in [dep.server, *dep.clients]:
        prepare_kit(
            dep.kit(participant),
            storage=ws / "storage" if participant == dep.server else None,
            org_admin_jobs=org_admin_jobs,
        )
    protect_keys(ws)
    dep.save()
    return dep


def protect_keys(root: str | Path) -> dict[str, list[str]]:
    """Make every private key under ``root`` and the provisioning state owner-only.

    ``*.key`` files get mode 0o600; each ``state`` folder (NVFlare's ``cert.json`` holds the root
    CA's and every participant's private key) 0o700 and every file in it 0o600.

    Args:
        root: a deployment workspace (or any folder holding kits).

    Returns:
        ``keys`` and ``state`` (folders): the paths made owner-only.
    """
    root = Path(root)
    keys = sorted(p for p in root.rglob("*.key") if p.is_file() and not p.is_symlink())
    states = sorted(p for p in root.rglob("state") if p.is_dir() and (p / "cert.json").is_file())
    for state in states:
        state.chmod(OWNER_ONLY_DIR)
        for p in state.rglob("*"):
            p.chmod(OWNER_ONLY_DIR if p.is_dir() else OWNER_ONLY_FILE)
    for key in keys:
        key.chmod(OWNER_ONLY_FILE)
    return {"keys": [str(p) for p in keys], "state": [str(p) for p in states]}


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
    """``server``, ``client`` or ``admin`` from the kit's startup files.

    Args:
        kit: the kit folder.
    """
    startup = Path(kit) / "startup"
    for kind, marker in (("server", "fed_server.json"), ("client", "fed_client.json"), ("admin", "fed_admin.json")):
        if (startup / marker).is_file():
            return kind
    raise DeployError(
        f"{kit} is not an NVFlare startup kit (no startup/fed_server.json, fed_client.json or fed_admin.json)"
    )


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
      (``org_admin_jobs=False``: :data:`ORG_ADMIN_ALWAYS` and org admins submit nothing).

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
        out.update(_move_server_storage(kit, res, storage))
    leftover = [s for s in _strings(res) if s.startswith("/tmp/nvflare")]
    if leftover:
        raise DeployError(f"{kit}/local/resources.json still points at {leftover}; edit it by hand")
    (kit / "local" / "resources.json").write_text(json.dumps(res, indent=2) + "\n")

    org_admin = _write_authorization(kit, org_admin_jobs)
    out["written"] = [str(kit / "local" / "resources.json"), str(kit / "local" / "authorization.json")]
    out["org_admin"] = org_admin
    return out


def _move_server_storage(kit: Path, res: dict[str, Any], storage: str | Path | None) -> dict[str, str]:
    """Point the server's job and snapshot storage at ``storage`` (default ``<kit>/storage``, owner-only) in ``res``."""
    root = Path(storage).resolve() if storage else kit / "storage"
    jobs, snapshots = root / "jobs-storage", root / "snapshot-storage"
    for folder in (jobs, snapshots):  # they keep every finished job's records: owner-only
        folder.mkdir(parents=True, exist_ok=True)
        for p in (folder, folder.parent):
            p.chmod(OWNER_ONLY_DIR)
    try:
        res["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"] = str(snapshots)
    except (KeyError, TypeError) as exc:
        raise DeployError(f"{kit}/local/resources.json has no snapshot_persistor storage to move") from exc
    managers = [c for c in res.get("components", []) if c.get("id") == "job_manager"]
    if not managers:
        raise DeployError(f"{kit}/local/resources.json has no job_manager component")
    for comp in managers:
        comp.setdefault("args", {})["uri_root"] = str(jobs)
    return {"jobs_storage": str(jobs), "snapshot_storage": str(snapshots)}


def _write_authorization(kit: Path, org_admin_jobs: bool) -> Any:
    """The kit's ``local/authorization.json`` with :data:`ORG_ADMIN_RIGHTS` (or no jobs); the org admin's entry."""
    policy = _load_local(kit, "authorization.json")
    permissions = policy.setdefault("permissions", {})
    org_admin = permissions.get("org_admin")
    if not isinstance(org_admin, dict):  # missing, or one expression for every right: replace by the explicit set
        org_admin = permissions["org_admin"] = {
            "view": "any",
            "operate": "o:site",
            "shell_commands": "o:site",
            "manage_job": "o:submitter",
            "submit_job": "none",
        }
    org_admin.update(ORG_ADMIN_RIGHTS if org_admin_jobs else {**ORG_ADMIN_ALWAYS, "submit_job": "none"})
    (kit / "local" / "authorization.json").write_text(json.dumps(policy, indent=2) + "\n")
    return org_admin


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
    """The participant name of a site kit (``fqsn`` in ``fed_client.json``), else the folder name.

    Args:
        kit: the kit folder.
    """
    path = Path(kit) / "startup" / "fed_client.json"
    if path.is_file():
        name = json.loads(path.read_text()).get("client", {}).get("fqsn")
        if name:
            return str(name)
    return Path(kit).name


def declare_gpus(kit: str | Path, gpus: Sequence[int]) -> dict[str, Any]:
    """Declare the GPUs a site offers jobs: its kit's ``resource_manager`` and ``resource_consumer``.

    :data:`GPU_MANAGER` holds one unit per index, so a job asking for ``num_of_gpus`` (NVFlare's
    ``@default`` or the site's own request) gets the site only while that many are free and holds
    them until it ends; :data:`GPU_CONSUMER` pins its process to them (``CUDA_VISIBLE_DEVICES``).
    Nothing else in ``local/resources.json`` changes. See :mod:`cxrfl.fl.resources`.

    Args:
        kit: the site's kit folder.
        gpus: GPU indices as ``nvidia-smi`` numbers them; empty: the site offers no GPU.

    Returns:
        ``kit``, ``gpus`` and ``written`` (the file).
    """
    from cxrfl.fl.resources import GPU_KEY

    kit, gpus = Path(kit).resolve(), list(gpus)
    if kit_kind(kit) != "client":
        raise DeployError(f"{kit} is not a site (client) kit: GPUs are declared on a site kit")
    if len(set(gpus)) != len(gpus) or any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus):
        raise DeployError(f"gpus must list distinct GPU indices (nvidia-smi's, >= 0), got {gpus}")
    res = _load_local(kit, "resources.json")
    others = [c for c in res.get("components", []) if c.get("id") not in ("resource_manager", "resource_consumer")]
    res["components"] = [
        {
            "id": "resource_manager",
            "path": GPU_MANAGER,
            "args": {"resources": {GPU_KEY: gpus}, "expiration_period": 300},
        },
        {"id": "resource_consumer", "path": GPU_CONSUMER, "args": {}},
        *others,
    ]
    path = kit / "local" / "resources.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    return {"kit": str(kit), "gpus": gpus, "written": str(path)}


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
    header = (
        f"# {name}'s data, read by cxrfl at job start "
        f"(written by `cxrfl deploy site-config` from {Path(config).resolve()})\n"
    )
    target.write_text(header + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return target
