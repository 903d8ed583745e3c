"""The NVFlare job folders under ``jobs/``, defined in Python.

``cxrfl jobs export --out jobs`` writes them; a test regenerates them and compares with the
committed folders, so the two never drift. Every argument is written explicitly (no reliance
on NVFlare's defaults). Jobs carry no site data: each site reads its own config at run time.
The ``app/custom`` folder holds only a README: the code comes from the installed ``cxrfl``
package. :func:`write_job` also writes the two deployment variants (``cxrfl deploy job``):
``custom="none"`` (no ``app/custom``: sites pre-install cxrfl and allow ``cxrfl.`` in their
``class_allow_list``) and ``custom="package"`` (bring-your-own-code: the package is copied into
``app/custom``). Privacy filters on site results are JobSpec options, off by default.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cxrfl.nn.models import ModelConfig
from cxrfl.nn.training import TrainConfig

ANALYTICS_EVENT = "analytix_log_stats"

CUSTOM_README = """\
This job's code is the installed `cxrfl` package (pip install cxrfl / pip install -e .).
The folder exists so NVFlare treats the job as bring-your-own-code; sites that pre-install the
package and allow the `cxrfl.` prefix in local/resources.json can submit the job without it.
"""


@dataclass(frozen=True)
class JobSpec:
    """One job folder.

    Args:
        name: folder and job name.
        controller: server workflow class path.
        controller_args: its arguments (written in full).
        executor_args: :class:`cxrfl.fl.surgical.SiteExecutor` arguments.
        min_clients: sites needed to start the job.
        resource_spec: per-site resources NVFlare checks before deploying (e.g. GPUs).
        description: one line for meta.json.
        privacy: None (default: off), or ``{"method": "percentile" | "svt", "args": {...}}``:
            NVFlare's ``PercentilePrivacy`` / ``SVTPrivacy`` on every ``train`` result, applied to
            the weight difference by :class:`cxrfl.fl.privacy.UpdatePrivacy` (missing args: the
            values in :data:`PRIVACY_DEFAULTS`, written explicitly).
        exclude_batchnorm: add NVFlare's ``ExcludeVars`` result filter naming every BatchNorm
            entry of the model, so none leaves a site (FedBN/FedBN+ only; default off).
        executor: site executor class path.
        tasks: the tasks the executor answers.
    """

    name: str
    controller: str
    controller_args: dict[str, Any]
    executor_args: dict[str, Any] = field(
        default_factory=lambda: {"device": "auto", "num_workers": 0, "num_threads": 1, "analytic_sender_id": "analytic_sender"}
    )
    min_clients: int = 2
    resource_spec: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    privacy: dict[str, Any] | None = None
    exclude_batchnorm: bool = False
    executor: str = "cxrfl.fl.surgical.SiteExecutor"
    tasks: tuple[str, ...] = ("train", "validate")

    def __post_init__(self) -> None:
        if self.privacy is not None:
            method = self.privacy.get("method")
            if method not in PRIVACY_DEFAULTS:
                raise ValueError(f"{self.name}: privacy method must be one of {sorted(PRIVACY_DEFAULTS)}, got {method!r}")
            unknown = set(self.privacy) - {"method", "args"}
            if unknown:
                raise ValueError(f"{self.name}: unknown privacy key(s) {sorted(unknown)} (use 'method' and 'args')")
            bad = set(self.privacy.get("args") or {}) - set(PRIVACY_DEFAULTS[method])
            if bad:
                raise ValueError(f"{self.name}: unknown {method} privacy argument(s) {sorted(bad)}; known: {sorted(PRIVACY_DEFAULTS[method])}")
        if self.exclude_batchnorm and self.controller_args.get("batchnorm", "fedavg") == "fedavg":
            raise ValueError(
                f"{self.name}: exclude_batchnorm needs batchnorm 'fedbn' or 'fedbn+' (FedAvg averages BatchNorm, "
                f"so the server needs it from every site)"
            )

    def privacy_args(self) -> dict[str, Any]:
        """The privacy filter's full argument dict (defaults written explicitly); {} when off."""
        if self.privacy is None:
            return {}
        method = self.privacy["method"]
        return {**PRIVACY_DEFAULTS[method], **(self.privacy.get("args") or {})}

    def server_config(self) -> dict[str, Any]:
        return {
            "format_version": 2,
            "workflows": [{"id": "controller", "path": self.controller, "args": self.controller_args}],
            "components": [
                {
                    "id": "tb_receiver",
                    "path": "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver",
                    "args": {"tb_folder": "tb_events", "events": [f"fed.{ANALYTICS_EVENT}"]},
                }
            ],
        }

    def client_config(self) -> dict[str, Any]:
        return {
            "format_version": 2,
            "executors": [
                {"tasks": list(self.tasks), "executor": {"path": self.executor, "args": self.executor_args}}
            ],
            "components": [
                {"id": "analytic_sender", "path": "nvflare.app_opt.tracking.tb.tb_writer.TBWriter",
                 "args": {"event_type": ANALYTICS_EVENT}},
                {"id": "event_to_fed", "path": "nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
                 "args": {"events_to_convert": [ANALYTICS_EVENT], "fed_event_prefix": "fed."}},
            ],
            "task_data_filters": self._data_filters(),
            "task_result_filters": self._result_filters(),
        }

    def _data_filters(self) -> list[dict[str, Any]]:
        if self.privacy is None:
            return []
        # the same filter class remembers what the site received (see cxrfl.fl.privacy)
        return [{"tasks": ["train"], "filters": [self._privacy_filter()]}]

    def _result_filters(self) -> list[dict[str, Any]]:
        filters = []
        if self.exclude_batchnorm:
            keys = batchnorm_state_keys(ModelConfig.from_dict({**self.controller_args.get("model_config", {}), "pretrained": None}))
            filters.append({"path": "nvflare.app_common.filters.exclude_vars.ExcludeVars", "args": {"exclude_vars": keys}})
        if self.privacy is not None:
            filters.append(self._privacy_filter())
        return [{"tasks": ["train"], "filters": filters}] if filters else []

    def _privacy_filter(self) -> dict[str, Any]:
        return {"path": PRIVACY_FILTER, "args": {"method": self.privacy["method"], "args": self.privacy_args()}}

    def meta(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "resource_spec": self.resource_spec,
            "deploy_map": {"app": ["@ALL"]},
            "min_clients": self.min_clients,
        }


PRIVACY_FILTER = "cxrfl.fl.privacy.UpdatePrivacy"

PRIVACY_DEFAULTS: dict[str, dict[str, Any]] = {
    "percentile": {"percentile": 10, "gamma": 0.01},
    "svt": {"fraction": 0.1, "epsilon": 0.1, "noise_var": 0.1, "gamma": 1e-5, "tau": 1e-6},
}
"""NVFlare's own defaults of ``PercentilePrivacy`` and ``SVTPrivacy`` (2.9), written into jobs explicitly."""


def batchnorm_state_keys(model: ModelConfig) -> list[str]:
    """Every BatchNorm state-dict entry of the network (selected by module type, not by name).

    Args:
        model: the network settings (``pretrained`` is ignored: names do not depend on weights).
    """
    from cxrfl.nn.models import batchnorm_keys, build_model

    return batchnorm_keys(build_model(ModelConfig.from_dict({**model.to_dict(), "pretrained": None}), 1))


def _with_overrides(args: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``args`` updated with ``overrides``; an override that is not an argument is a ValueError."""
    unknown = set(overrides) - set(args)
    if unknown:
        raise ValueError(f"unknown controller argument(s): {sorted(unknown)}")
    return {**args, **overrides}


def surgical_args(model: ModelConfig, train: TrainConfig, **overrides: Any) -> dict[str, Any]:
    """Full argument dict of :class:`cxrfl.fl.surgical.SurgicalAggregation` (defaults: :class:`cxrfl.surgical.config.SurgicalConfig`).

    Args:
        model: network settings.
        train: site training settings.
        overrides: other controller arguments.
    """
    from cxrfl.surgical.config import SurgicalConfig

    args = {**SurgicalConfig(model_config=model, train_config=train).to_dict(), "task_timeout": 3600}
    return _with_overrides(args, overrides)


def cwt_args(model: ModelConfig, cwt: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """Full argument dict of :class:`cxrfl.fl.cwt.CyclicWeightTransfer` (every CWT setting written).

    Args:
        model: network settings.
        cwt: :class:`cxrfl.cwt.CWTConfig` fields that differ from its defaults.
        overrides: other controller arguments.
    """
    from cxrfl.cwt.config import CWTConfig, RelayConfig

    args: dict[str, Any] = {
        "cwt_config": CWTConfig.from_dict(cwt).to_dict(),
        "model_config": model.to_dict(),
        **RelayConfig().to_dict(),
        "task_timeout": 3600,
        "resume_from": None,
    }
    return _with_overrides(args, overrides)


def fedfew_args(model: ModelConfig, fedfew: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """Full argument dict of :class:`cxrfl.fl.fedfew.FedFew` (every FedFew setting written).

    Args:
        model: network settings.
        fedfew: :class:`cxrfl.fedfew.config.FedFewConfig` fields that differ from its defaults.
        overrides: other controller arguments.
    """
    from cxrfl.fedfew.config import FedFewConfig

    args: dict[str, Any] = {
        "fedfew_config": FedFewConfig.from_dict(fedfew).to_dict(),
        "model_config": model.to_dict(),
        "min_clients": 1,
        "task_timeout": 0,
        "resume_from": None,
        "evaluate_test": True,
    }
    return _with_overrides(args, overrides)


DEMO_MODEL = ModelConfig(image_size=64)
"""CPU demo setting: 64x64 inputs, trained from scratch (no weights can be downloaded here)."""

DEMO_TRAIN = TrainConfig(lr=1e-3, warmup_lr=5e-3, warmup_epochs=2, local_epochs=1, batch_size=32)
"""CPU demo setting: from-scratch learning rates, short warm-up."""

CLINICAL_MODEL = ModelConfig(image_size=224)
CLINICAL_TRAIN = TrainConfig()

SURGICAL = "cxrfl.fl.surgical.SurgicalAggregation"
CWT = "cxrfl.fl.cwt.CyclicWeightTransfer"
CWT_EXECUTOR = "cxrfl.fl.cwt.CWTExecutor"
FEDFEW = "cxrfl.fl.fedfew.FedFew"
FEDFEW_EXECUTOR = "cxrfl.fl.fedfew.FedFewExecutor"
FEDFEW_TASKS = ("fedfew_info", "fedfew_ssl", "fedfew_train", "fedfew_energy", "fedfew_prototypes", "fedfew_validate")
"""The tasks of :mod:`cxrfl.fedfew.protocol` (written here to keep this module light; a test checks they match)."""
FEDFEW_DEMO = {"ssl_rounds": 2, "rounds": 4, "warmup_rounds": 1}
"""CPU demo setting of FedFew: 2 SimSiam rounds, 1 warm-up + 4 energy rounds, margins from the warm-up."""
CWT_DEMO = {"task": "binary", "num_cycles": 10, "order": "fixed", "plti": True, "clr": False, "lwms": False,
            "cwl": False, "lr": 1e-3, "batch_size": 32, "patience": 3}
"""CPU demo setting of CWT: the paper's binary task, PLTI on (switch the others in the job's server config)."""

JOBS: tuple[JobSpec, ...] = (
    JobSpec(
        name="surgical_agg",
        controller=SURGICAL,
        controller_args=surgical_args(DEMO_MODEL, DEMO_TRAIN, num_rounds=6, patience=3),
        description="Surgical aggregation (FedAvg feature extractor), CPU-sized demo settings",
    ),
    JobSpec(
        name="surgical_agg_fedbn_plus",
        controller=SURGICAL,
        controller_args=surgical_args(DEMO_MODEL, DEMO_TRAIN, num_rounds=6, patience=3, batchnorm="fedbn+"),
        description="Surgical aggregation with FedBN+ (BatchNorm frozen at initial statistics)",
    ),
    JobSpec(
        name="surgical_agg_gpu",
        controller=SURGICAL,
        controller_args=surgical_args(CLINICAL_MODEL, CLINICAL_TRAIN, num_rounds=150, patience=25, task_timeout=86400),
        resource_spec={"@ALL": {"num_of_gpus": 1, "mem_per_gpu_in_GiB": 16}},
        description="Surgical aggregation, the papers' clinical settings (224x224, 150 rounds), one GPU per site",
    ),
    # ---- the papers' federated baselines: the same workflow, another head mode (cxrfl.surgical.head_modes)
    JobSpec(
        name="vanilla_fl",
        controller=SURGICAL,
        controller_args=surgical_args(DEMO_MODEL, DEMO_TRAIN, num_rounds=6, patience=3, head_mode="union", missing="negative"),
        description="Baseline: vanilla FL (FedAvg of a union head, classes a site does not annotate are negatives). "
        "Every site receives every class name: not class-private",
    ),
    JobSpec(
        name="fl_partial_loss",
        controller=SURGICAL,
        controller_args=surgical_args(DEMO_MODEL, DEMO_TRAIN, num_rounds=6, patience=3, head_mode="union", missing="ignore"),
        description="Baseline: FL with partial loss (FedAvg of a union head, loss on the site's own classes only). "
        "Every site receives every class name: not class-private",
    ),
    JobSpec(
        name="personalized_fl",
        controller=SURGICAL,
        controller_args=surgical_args(DEMO_MODEL, DEMO_TRAIN, num_rounds=6, patience=3, head_mode="local"),
        description="Baseline: personalized FL (FedAvg feature extractor, heads stay at the sites; no global model)",
    ),
    JobSpec(
        name="personalized_fl_fedbn",
        controller=SURGICAL,
        controller_args=surgical_args(DEMO_MODEL, DEMO_TRAIN, num_rounds=6, patience=3, head_mode="local", batchnorm="fedbn"),
        description="Baseline: personalized FL with FedBN (BatchNorm and heads stay at the sites; no global model)",
    ),
    # ---- cyclical weight transfer (cxrfl.cwt): one model relayed site to site, no aggregation
    JobSpec(
        name="cwt",
        controller=CWT,
        controller_args=cwt_args(DEMO_MODEL, CWT_DEMO),
        executor=CWT_EXECUTOR,
        tasks=("counts", "train", "validate"),
        description="Cyclical weight transfer (PLTI, CLR, LWMS, CWL switchable in cwt_config), CPU-sized demo settings. "
        "The whole model travels: not class-private",
    ),
    # ---- FedFew (cxrfl.fedfew): rare classes held by few sites, three stages in one workflow
    JobSpec(
        name="fedfew",
        controller=FEDFEW,
        controller_args=fedfew_args(DEMO_MODEL, FEDFEW_DEMO),
        executor=FEDFEW_EXECUTOR,
        tasks=FEDFEW_TASKS,
        description="FedFew: federated SimSiam, energy-based CC classifier, energy threshold and UC prototypes "
        "(one final model), CPU-sized demo settings. The whole model travels; the server learns which site labels which class",
    ),
)


CUSTOM_MODES = ("readme", "none", "package")


def write_job(spec: JobSpec, out: Path, *, custom: str = "readme") -> Path:
    """Write one job folder.

    Args:
        spec: the job.
        out: parent folder (the job goes to ``out/spec.name``).
        custom: what ``app/custom`` holds: ``readme`` (the committed jobs: only a README, the
            code is the installed package; NVFlare counts it as bring-your-own-code), ``none``
            (no ``app/custom``: the pre-installed deployment mode) or ``package`` (the ``cxrfl``
            package copied in: the bring-your-own-code deployment mode).
    """
    if custom not in CUSTOM_MODES:
        raise ValueError(f"custom must be one of {CUSTOM_MODES}, got {custom!r}")
    root = Path(out) / spec.name
    config = root / "app" / "config"
    config.mkdir(parents=True, exist_ok=True)

    def dump(path: Path, obj: dict) -> None:
        path.write_text(json.dumps(obj, indent=2) + "\n")

    dump(root / "meta.json", spec.meta())
    dump(config / "config_fed_server.json", spec.server_config())
    dump(config / "config_fed_client.json", spec.client_config())
    if custom == "readme":
        (root / "app" / "custom").mkdir(parents=True, exist_ok=True)
        (root / "app" / "custom" / "README.md").write_text(CUSTOM_README)
    elif custom == "package":
        import cxrfl

        shutil.copytree(
            Path(cxrfl.__file__).resolve().parent,
            root / "app" / "custom" / "cxrfl",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo"),
        )
    return root


def export_all(out: Path) -> list[Path]:
    """Write every job in :data:`JOBS`.

    Args:
        out: the folder that holds the job folders (``jobs/``).
    """
    return [write_job(spec, Path(out)) for spec in JOBS]
