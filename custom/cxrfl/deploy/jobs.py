"""Deployable job folders, written from the recipes of the jobs of :data:`cxrfl.jobs.JOBS`."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cxrfl.deploy.workspace import DeployError
from cxrfl.errors import ConfigError
from cxrfl.fl.packaging import PACKAGING


def build_job(
    name: str,
    out: str | Path,
    *,
    mode: str = "preinstalled",
    overrides: dict[str, Any] | None = None,
    privacy: dict[str, Any] | None = None,
    exclude_batchnorm: bool = False,
    quantize: str | None = None,
    job_name: str | None = None,
    tracking: Sequence[str] | None = None,
    tracking_uri: str | None = None,
    sites: Sequence[str] | None = None,
) -> Path:
    """Write a deployable job folder from a job in :data:`cxrfl.jobs.JOBS` (its recipe, exported).

    Args:
        name: the job (``surgical_agg``, ...).
        out: parent folder; the job is written to ``out/<job_name or name>`` (must not exist).
        mode: ``preinstalled`` (no ``app/custom``), ``byoc`` (package in ``app/custom``) or
            ``readme`` (as committed under ``jobs/``).
        overrides: workflow arguments to change, dotted for nested ones
            (``{"num_rounds": 2, "train_config.batch_size": 16}``); any argument the job writes (a
            surgical job's ``weighting``, ``robust`` and ``clip_norm`` go to its aggregator component).
        privacy: ``{"method": "percentile" | "svt", "args": {...}}`` (see :class:`cxrfl.jobs.JobSpec`).
        exclude_batchnorm: add the ExcludeVars filter of every BatchNorm entry (FedBN/FedBN+).
        quantize: an NVFlare quantization format for what the server sends and the sites return
            (``float16``, ``blockwise8``, ``float4``, ``normfloat4``); None: off.
        job_name: another name for the job (folder and meta).
        tracking: experiment trackers (``tensorboard``, ``mlflow``; empty: none); None: the job's.
        tracking_uri: MLflow tracking server; None: an SQLite file in the job's server workspace.
        sites: the client sites by name (the server's app then goes to the server alone; FedFew needs
            them); None: the job's (``fedfew``: site-1, site-2; the others: NVFlare's ``@ALL``).
    """
    from cxrfl.jobs import JOBS, write_job

    specs = {s.name: s for s in JOBS}
    if name not in specs:
        raise DeployError(f"unknown job {name!r}; jobs: {sorted(specs)}")
    if mode not in PACKAGING:
        raise DeployError(f"mode must be one of {list(PACKAGING)}, got {mode!r}")
    spec = specs[name]
    args = {k: v for k, v in copy.deepcopy(spec.recipe().job_arguments).items() if k != "analytic_sender_id"}
    for key, value in (overrides or {}).items():
        _set(args, key, value, name)
    # meta.json's min_clients (sites needed to schedule the job) follows an explicit min_clients override
    meta_min = int(overrides["min_clients"]) if "min_clients" in (overrides or {}) else spec.min_clients
    spec = dataclasses.replace(
        spec,
        name=job_name or spec.name,
        controller_args=args,
        privacy=privacy,
        exclude_batchnorm=exclude_batchnorm,
        quantize=quantize,
        min_clients=meta_min,
        tracking_uri=tracking_uri,
        tracking=spec.tracking if tracking is None else tuple(tracking),
        sites=spec.sites if sites is None else tuple(sites),
    )
    out = Path(out)
    if (out / spec.name).exists():
        raise DeployError(f"{out / spec.name} exists; choose another --out")
    try:
        return write_job(spec, out, custom=mode)
    except (ConfigError, ValueError) as exc:
        raise DeployError(str(exc)) from exc


def _set(args: dict[str, Any], key: str, value: Any, job: str) -> None:
    """Set one (dotted) workflow argument; an unknown one is a DeployError naming the known ones."""
    node = args
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            raise DeployError(f"cannot set {key!r}: {part!r} is not a group of settings")
        node = node[part]
    if parts[-1] not in node:
        raise DeployError(f"unknown setting {key!r} of job {job}; known: {sorted(node)}")
    node[parts[-1]] = value
