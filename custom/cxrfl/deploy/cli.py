"""``cxrfl deploy ...``: real deployment with NVFlare 2.9's own tools (``nvflare provision``,
``nvflare poc``, ``startup/sub_start.sh``, the FLARE API), for the steps a project lead, a
hospital's IT person and a researcher do:

====================  =====================================================================
``provision``         kits for every participant of ``poc/project.yml`` (real certificates), in
                      production (``nvflare provision``) or POC mode (``nvflare poc prepare -i``),
                      then ``prepare-kit`` on each kit (:mod:`cxrfl.deploy.provision`)
``prepare-kit``       one kit's ``local/``: ``resources.json`` (job and snapshot storage moved out
                      of /tmp/nvflare, ``cxrfl.`` added to ``class_allow_list``) and
                      ``authorization.json`` (:data:`cxrfl.deploy.provision.ORG_ADMIN_RIGHTS`)
``site-gpus``         the GPUs a site offers jobs, one job per GPU, in its kit's ``local/resources.json``
                      (:func:`cxrfl.deploy.provision.declare_gpus`)
``site-config``       a hospital's data config into its kit: ``local/cxrfl_site.yaml``
``job``               a job folder for deployment: ``preinstalled`` (no ``app/custom``) or
                      ``byoc`` (the package copied into ``app/custom``), optional privacy filters and quantization
                      (:mod:`cxrfl.deploy.jobs`)
``start`` / ``stop``  the server and sites of a workspace as background processes (no watchdog
                      loop in production mode; ``nvflare poc start/stop`` in POC mode); ``stop``
                      checks that every process is gone (:mod:`cxrfl.deploy.processes`)
``status``            processes, connected sites and jobs of a workspace
``submit`` / ``abort``  submit a job from an admin kit with the FLARE API, wait, download the
                      result; abort a running job (:mod:`cxrfl.deploy.admin`)
``download``          a finished job's result (project admin: every job; lead: its own; org
                      admins none: docs/security.md)
====================  =====================================================================

The workspace layout: :mod:`cxrfl.deploy.workspace`. Every command prints JSON (or a path) on
stdout; NVFlare's own output goes to stderr. This module and those it imports load only the
standard library and PyYAML (``cxrfl --help`` stays fast); NVFlare, psutil and the job
definitions are imported where needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cxrfl.deploy.admin import COMPLETED, abort, admin_session, download, submit
from cxrfl.deploy.jobs import build_job
from cxrfl.deploy.processes import find_processes, start, stop
from cxrfl.deploy.provision import (
    ALLOW_PREFIXES,
    declare_gpus,
    install_site_config,
    prepare_kit,
    protect_keys,
    provision,
)
from cxrfl.deploy.workspace import DeployError, Deployment
from cxrfl.fl.packaging import PACKAGING


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
    dep = provision(
        args.project,
        args.workspace,
        poc=args.poc,
        server_host=args.server_host,
        port=args.port,
        org_admin_jobs=not args.no_org_admin_jobs,
    )
    _print(asdict(dep))
    private = protect_keys(dep.ws)  # provision did it; this lists them
    print(
        f"private keys and provisioning state are owner-only (files 0o600, folders 0o700): {len(private['keys'])} key "
        f"files, {len(private['state'])} state folder(s) under {dep.ws}; keep the state folder (root CA key) offline",
        file=sys.stderr,
    )
    print(
        f"kits in {dep.kits}; next: cxrfl deploy site-config --workspace {args.workspace} SITE CONFIG.yaml",
        file=sys.stderr,
    )
    return 0


def _gpu_indices(text: str) -> list[int]:
    """``--gpus``: comma-separated GPU indices; ``none`` or empty: no GPU."""
    items = [t.strip() for t in text.split(",") if t.strip() and t.strip().lower() != "none"]
    if not all(t.isdigit() for t in items):
        raise argparse.ArgumentTypeError(f"expected GPU indices such as 0,1 (or none), got {text!r}")
    return [int(t) for t in items]


def _cmd_prepare_kit(args: argparse.Namespace) -> int:
    _print(
        prepare_kit(
            _kit_arg(args, args.kit),
            storage=args.storage,
            allow=tuple(args.allow or ALLOW_PREFIXES),
            org_admin_jobs=not args.no_org_admin_jobs,
        )
    )
    return 0


def _cmd_site_gpus(args: argparse.Namespace) -> int:
    _print(declare_gpus(_kit_arg(args, args.kit), args.gpus))
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
    tracking = None if args.tracking is None else [t for t in args.tracking.split(",") if t]
    _emit(
        str(
            build_job(
                args.name,
                args.out,
                mode=args.mode,
                overrides=_kv(args.set),
                privacy=privacy,
                exclude_batchnorm=args.exclude_batchnorm,
                quantize=args.quantize,
                job_name=args.job_name,
                tracking=tracking,
                tracking_uri=args.tracking_uri,
                sites=None if args.sites is None else [s for s in args.sites.split(",") if s],
            )
        )
    )
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
    result = submit(
        args.job,
        workspace=args.workspace,
        admin=args.admin,
        kit=args.kit,
        wait=not args.no_wait,
        timeout=args.timeout,
        download=args.download,
    )
    _print(result)
    if result.get("refused"):
        print(f"cxrfl: job refused for {result['admin']}: {result['refused']}", file=sys.stderr)
        return 1
    if result.get("not_scheduled"):
        spec = result["resource_spec"]
        asks = f"; it asks {json.dumps(spec)} (sites declare GPUs with `cxrfl deploy site-gpus`)" if spec else ""
        print(
            f"cxrfl: job {result['job_id']} not scheduled ({result['status']}): {result['not_scheduled']}{asks}",
            file=sys.stderr,
        )
        return 1
    return _download_status(result) if result.get("status") in (COMPLETED, "SUBMITTED") else 1


def _download_status(result: dict[str, Any]) -> int:
    if result.get("download_refused"):
        print(
            f"cxrfl: download of job {result.get('job_id')} refused for {result.get('admin')}: "
            f"{result['download_refused']} (org admins download no job results; see docs/security.md)",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_download(args: argparse.Namespace) -> int:
    result = download(args.job_id, workspace=args.workspace, admin=args.admin, destination=args.out)
    _print(result)
    return _download_status(result)


def _cmd_abort(args: argparse.Namespace) -> int:
    result = abort(
        args.job_id, workspace=args.workspace, admin=args.admin, timeout=args.timeout, download=args.download
    )
    _print(result)
    return 0 if str(result.get("status", "")).startswith("FINISHED") else 1


def _cmd_stop(args: argparse.Namespace) -> int:
    result = stop(args.workspace, timeout=args.timeout)
    _print(result)
    return 0 if not result["left"] else 1


def _add_setup_commands(ds: argparse._SubParsersAction) -> None:
    """``provision``, ``prepare-kit``, ``site-gpus``, ``site-config``."""
    p = ds.add_parser("provision", help="provision every participant of a project.yml into a workspace")
    p.add_argument("--project", default="poc/project.yml", help="NVFlare project file (default poc/project.yml)")
    p.add_argument("--workspace", required=True, help="deployment workspace (everything is written under it)")
    p.add_argument("--poc", action="store_true", help="POC mode (nvflare poc prepare -i) instead of production")
    p.add_argument("--server-host", help="host the sites connect to (e.g. localhost for one machine)")
    p.add_argument("--port", type=int, help="the server's port (FL and admin traffic)")
    p.add_argument(
        "--no-org-admin-jobs", action="store_true", help="org admins submit no jobs (they never download any)"
    )
    p.set_defaults(func=_quiet(_cmd_provision))

    p = ds.add_parser(
        "prepare-kit", help="a kit's local/resources.json (storage, class_allow_list) and authorization.json"
    )
    p.add_argument("kit", help="kit folder, or a participant name with --workspace")
    p.add_argument("--workspace")
    p.add_argument("--storage", help="server job and snapshot storage folder (default <kit>/storage)")
    p.add_argument("--allow", action="append", help="class-path prefix to allow (default: cxrfl.)")
    p.add_argument("--no-org-admin-jobs", action="store_true")
    p.set_defaults(func=_quiet(_cmd_prepare_kit))

    p = ds.add_parser("site-gpus", help="the GPUs a site offers jobs (its kit's resource manager), one job per GPU")
    p.add_argument("kit", help="the site's kit folder, or its name with --workspace")
    p.add_argument("gpus", type=_gpu_indices, help="GPU indices as nvidia-smi numbers them, e.g. 0,1 ('none': no GPU)")
    p.add_argument("--workspace")
    p.set_defaults(func=_quiet(_cmd_site_gpus))

    p = ds.add_parser("site-config", help="put a site's data config into its kit (local/cxrfl_site.yaml)")
    p.add_argument("kit", help="the site's kit folder, or its name with --workspace")
    p.add_argument("config", help="the site config YAML (site_configs/README.md)")
    p.add_argument("--workspace")
    p.set_defaults(func=_quiet(_cmd_site_config))


def _add_job_command(ds: argparse._SubParsersAction) -> None:
    """``job``: a deployable job folder."""
    p = ds.add_parser("job", help="write a deployable job folder (pre-installed or bring-your-own-code)")
    p.add_argument("name", help="a job of cxrfl.jobs.JOBS: the folder names under jobs/ (surgical_agg, ...)")
    p.add_argument("--out", required=True, help="parent folder of the job folder")
    p.add_argument(
        "--mode",
        choices=list(PACKAGING),
        default="preinstalled",
        help="preinstalled: no app/custom (sites allow cxrfl.); byoc: package in app/custom",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="change a controller setting, e.g. num_rounds=2 or train_config.batch_size=16 (JSON values)",
    )
    p.add_argument("--privacy", choices=["percentile", "svt"], help="NVFlare privacy filter on site results")
    p.add_argument("--privacy-arg", action="append", metavar="KEY=VALUE", help="its arguments, e.g. gamma=0.05")
    p.add_argument(
        "--exclude-batchnorm", action="store_true", help="ExcludeVars filter of BatchNorm entries (FedBN/FedBN+)"
    )
    p.add_argument(
        "--quantize",
        metavar="TYPE",
        help="quantize what the server sends and the sites return: float16, blockwise8, float4 or normfloat4 "
        "(default: off; BatchNorm statistics stay exact; needs pip install 'cxrfl[quantization]')",
    )
    p.add_argument("--job-name", help="another job (folder) name")
    p.add_argument(
        "--sites",
        help="the client sites, comma-separated: the server's app goes to the server alone and "
        "each site gets a client app (needed for fedfew; default: the job's)",
    )
    p.add_argument(
        "--tracking",
        help="experiment trackers, comma-separated: tensorboard, mlflow ('' for none; default: the job's, tensorboard)",
    )
    p.add_argument(
        "--tracking-uri",
        help="MLflow tracking server (default: an SQLite file mlflow.db in the job's server workspace folder)",
    )
    p.set_defaults(func=_quiet(_cmd_job))


def _add_run_commands(ds: argparse._SubParsersAction) -> None:
    """``start``, ``status``, ``submit``, ``download``, ``abort``, ``stop``."""
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

    p = ds.add_parser("download", help="download a finished job's result (project admin: any job; org admins: none)")
    p.add_argument("job_id")
    p.add_argument("--workspace", required=True)
    p.add_argument("--admin", help="admin name (default: the project admin)")
    p.add_argument("--out", required=True, help="folder to download into")
    p.set_defaults(func=_quiet(_cmd_download))

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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``deploy`` command group to the ``cxrfl`` parser.

    Args:
        sub: the top-level subparsers.
    """
    d = sub.add_parser("deploy", help="real deployment: provision, prepare kits, start, submit, stop")
    ds = d.add_subparsers(dest="deploy_command", required=True)
    _add_setup_commands(ds)
    _add_job_command(ds)
    _add_run_commands(ds)
