"""The NVFlare job folders under ``jobs/``: exports of the cxrfl recipes (:mod:`cxrfl.fl.recipes`).

Each :class:`JobSpec` holds one job's recipe arguments; :func:`write_job` builds the recipe and
exports it (NVFlare's own exporter, every argument written explicitly), and ``cxrfl jobs export
--out jobs`` writes them all; a test regenerates them and compares with the committed folders, so
the two never drift. Jobs carry no site data: each site reads its own config at run time. The
``app/custom`` folder holds only a README: the code comes from the installed ``cxrfl`` package.
:func:`write_job` also writes the two deployment variants (``cxrfl deploy job``): ``custom="preinstalled"``
(no ``app/custom``: sites pre-install cxrfl and allow ``cxrfl.`` in their ``class_allow_list``) and
``custom="byoc"`` (bring-your-own-code: the package is copied into ``app/custom``). Privacy
filters on site results and MLflow tracking are JobSpec options, off by default. This module
imports NVFlare only when a job is written.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cxrfl.fedfew.protocol import TASKS as FEDFEW_TASKS  # noqa: F401  (the fedfew job's tasks, for its tests)
from cxrfl.fl.packaging import PACKAGING, packaging
from cxrfl.fl.site_config import DEMO_SITES
from cxrfl.job_folders import app_dirs
from cxrfl.nn.models import ModelConfig
from cxrfl.nn.training import TrainConfig


@dataclass(frozen=True)
class JobSpec:
    """One job folder: the arguments of its recipe.

    Args:
        name: folder and job name.
        controller: server workflow class path (:data:`SURGICAL`, :data:`CWT` or :data:`FEDFEW`:
            picks the recipe).
        controller_args: the workflow's arguments (the recipe writes every other one at its default).
        executor_args: the sites' executor arguments (device, num_workers, num_threads).
        min_clients: sites needed to start the job.
        resources: what every site must offer before NVFlare gives it the job (NVFlare's ``@default``:
            ``num_of_gpus``, ``num_of_cpus``, ``memory``; see :class:`cxrfl.fl.job_settings.JobSettings`).
        site_resources: one site's own request over ``resources``.
        description: one line for meta.json.
        privacy: None (default: off), or ``{"method": "percentile" | "svt", "args": {...}}``
            (see :class:`cxrfl.fl.job_settings.JobSettings`).
        exclude_batchnorm: add NVFlare's ``ExcludeVars`` result filter naming every BatchNorm
            entry of the model, so none leaves a site (FedBN/FedBN+ only; default off).
        quantize: None (default: off), or an NVFlare quantization format for every message
            (see :class:`cxrfl.fl.job_settings.JobSettings`).
        tracking: experiment trackers: ``tensorboard`` and/or ``mlflow`` (empty: none).
        tracking_uri: MLflow tracking server; None: an SQLite file in the job's server workspace.
        sites: the client sites by name: the server's app then goes to the server alone (empty: one
            app, the server's config included, to NVFlare's ``@ALL``; see :class:`cxrfl.fl.job_settings.JobSettings`).
    """

    name: str
    controller: str
    controller_args: dict[str, Any]
    executor_args: dict[str, Any] = field(
        default_factory=lambda: {"device": "auto", "num_workers": 0, "num_threads": 1}
    )
    min_clients: int = 2
    resources: dict[str, Any] = field(default_factory=dict)
    site_resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    description: str = ""
    privacy: dict[str, Any] | None = None
    exclude_batchnorm: bool = False
    quantize: str | None = None
    tracking: tuple[str, ...] = ("tensorboard",)
    tracking_uri: str | None = None
    sites: tuple[str, ...] = ()

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks the job's site executor answers."""
        return self.recipe_class().tasks

    def recipe_class(self) -> type:
        """The recipe of this job's workflow."""
        from cxrfl.fl.recipes import CWTRecipe, FedFewRecipe, SurgicalAggregationRecipe

        recipes = {SURGICAL: SurgicalAggregationRecipe, CWT: CWTRecipe, FEDFEW: FedFewRecipe}
        if self.controller not in recipes:
            raise ValueError(f"{self.name}: no recipe for workflow {self.controller!r}; known: {sorted(recipes)}")
        return recipes[self.controller]

    def recipe(self, custom: str = "readme") -> Any:
        """The job's recipe (:mod:`cxrfl.fl.recipes`).

        Args:
            custom: the recipe's ``custom`` (``readme`` or ``none``).

        Raises:
            ConfigError: a bad setting (one line naming it).
        """
        from cxrfl.errors import ConfigError

        args = dict(self.controller_args)
        job = {
            "name": self.name,
            "min_clients": self.min_clients,
            "description": self.description,
            "resources": self.resources,
            "site_resources": self.site_resources,
            "privacy": self.privacy,
            "quantize": self.quantize,
            "tracking": self.tracking,
            "tracking_uri": self.tracking_uri,
            "custom": custom,
            "sites": self.sites,
            **self.executor_args,
        }
        if self.controller == FEDFEW:
            args["min_results"] = args.pop("min_clients", 1)
        elif self.controller == CWT and "min_sites" in args:  # the workflow's name; the recipe's is min_results
            args["min_results"] = args.pop("min_sites")
        elif self.controller == SURGICAL and args.pop("min_clients", self.min_clients) != self.min_clients:
            raise ConfigError(
                f"{self.name}: min_clients {self.min_clients} (sites to start) and the workflow's "
                f"min_clients {self.controller_args['min_clients']} (results per round) must agree"
            )
        if self.exclude_batchnorm:
            args["exclude_batchnorm"] = True
        return self.recipe_class()(**job, **args)


def _with_overrides(args: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``args`` updated with ``overrides``; an override that is not an argument is a ValueError."""
    unknown = set(overrides) - set(args)
    if unknown:
        raise ValueError(f"unknown controller argument(s): {sorted(unknown)}")
    return {**args, **overrides}


def surgical_args(model: ModelConfig, train: TrainConfig, **overrides: Any) -> dict[str, Any]:
    """Full argument dict of :class:`cxrfl.fl.surgical.SurgicalAggregation`.

    Defaults: :class:`cxrfl.surgical.config.SurgicalConfig`.

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

DEMO_TIME_BUDGET = 450.0
"""The README demo's seconds for the sites' data, the warm-up and the rounds: with the simulator's start, the
final evaluation and ``cxrfl report`` the first command ends within 10 minutes on a 2-core CPU without
native bfloat16 (BENCHMARKS.md, README demo run); a fast CPU ends on ``patience`` first."""

CLINICAL_MODEL = ModelConfig(image_size=224)
"""The papers' clinical input size; no pretrained weights (none can be downloaded here)."""

CLINICAL_TRAIN = TrainConfig(lr=1e-3)
"""The papers' schedule (15 warm-up epochs, batch 64) with a from-scratch rate: the papers' Adam 5e-5
is for an ImageNet-initialised DenseNet121; with ``model_config.pretrained`` set, use
``train_config.lr=5e-5``."""

SURGICAL = "cxrfl.fl.surgical.SurgicalAggregation"
CWT = "cxrfl.fl.cwt.CyclicWeightTransfer"
FEDFEW = "cxrfl.fl.fedfew.FedFew"
FEDFEW_DEMO = {"ssl_rounds": 2, "rounds": 4, "warmup_rounds": 1}
"""CPU demo setting of FedFew: 2 SimSiam rounds, 1 warm-up + 4 energy rounds, margins from the warm-up."""
CWT_DEMO = {
    "task": "binary",
    "num_cycles": 10,
    "order": "fixed",
    "plti": True,
    "clr": False,
    "lwms": False,
    "cwl": False,
    "lr": 1e-3,
    "batch_size": 32,
    "patience": 3,
}
"""CPU demo setting of CWT: the paper's binary task, PLTI on (switch the others in the job's server config)."""

JOBS: tuple[JobSpec, ...] = (
    JobSpec(
        name="surgical_agg",
        controller=SURGICAL,
        controller_args=surgical_args(DEMO_MODEL, DEMO_TRAIN, num_rounds=20, patience=3, time_budget=DEMO_TIME_BUDGET),
        description="Surgical aggregation (FedAvg feature extractor), CPU-sized demo settings within a time budget",
    ),
    JobSpec(
        name="surgical_agg_fedbn",
        controller=SURGICAL,
        controller_args=surgical_args(DEMO_MODEL, DEMO_TRAIN, num_rounds=6, patience=3, batchnorm="fedbn"),
        description="Surgical aggregation with FedBN (BatchNorm stays at the sites), CPU-sized demo settings. "
        "FedBN+ (BatchNorm frozen at pretrained statistics) needs weights: batchnorm fedbn+ with "
        "model_config.pretrained",
    ),
    JobSpec(
        name="surgical_agg_gpu",
        controller=SURGICAL,
        controller_args=surgical_args(CLINICAL_MODEL, CLINICAL_TRAIN, num_rounds=150, patience=25, task_timeout=86400),
        executor_args={"device": "auto", "num_workers": "auto", "num_threads": 1},
        resources={"num_of_gpus": 1},
        description="Surgical aggregation, the papers' clinical settings (224x224, 15 warm-up epochs, 150 rounds) from "
        "scratch (Adam 1e-3; the papers' 5e-5 is for ImageNet weights in model_config.pretrained), one GPU per site",
    ),
    # ---- the papers' federated baselines: the same workflow, another head mode (cxrfl.surgical.head_modes)
    JobSpec(
        name="vanilla_fl",
        controller=SURGICAL,
        controller_args=surgical_args(
            DEMO_MODEL, DEMO_TRAIN, num_rounds=6, patience=3, head_mode="union", missing="negative"
        ),
        description="Baseline: vanilla FL (FedAvg of a union head, classes a site does not annotate are negatives). "
        "Every site receives every class name: not class-private",
    ),
    JobSpec(
        name="fl_partial_loss",
        controller=SURGICAL,
        controller_args=surgical_args(
            DEMO_MODEL, DEMO_TRAIN, num_rounds=6, patience=3, head_mode="union", missing="ignore"
        ),
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
        controller_args=surgical_args(
            DEMO_MODEL, DEMO_TRAIN, num_rounds=6, patience=3, head_mode="local", batchnorm="fedbn"
        ),
        description="Baseline: personalized FL with FedBN (BatchNorm and heads stay at the sites; no global model)",
    ),
    # ---- cyclical weight transfer (cxrfl.cwt): one model relayed site to site, no aggregation
    JobSpec(
        name="cwt",
        controller=CWT,
        controller_args=cwt_args(DEMO_MODEL, CWT_DEMO),
        description="Cyclical weight transfer (PLTI, CLR, LWMS, CWL switchable in cwt_config), CPU-sized demo "
        "settings. The whole model travels: not class-private",
    ),
    # ---- FedFew (cxrfl.fedfew): rare classes held by few sites, three stages in one workflow
    JobSpec(
        name="fedfew",
        controller=FEDFEW,
        controller_args=fedfew_args(DEMO_MODEL, FEDFEW_DEMO),
        sites=DEMO_SITES,
        description="FedFew: federated SimSiam, energy-based CC classifier, energy threshold and UC prototypes "
        "(one final model), CPU-sized demo settings. The whole model travels; the server learns which site "
        "labels which class",
    ),
)


def write_job(spec: JobSpec, out: Path, *, custom: str = "readme") -> Path:
    """Export one job's recipe.

    Args:
        spec: the job.
        out: parent folder (the job goes to ``out/spec.name``; an earlier export of the same job
            there is replaced).
        custom: how the job carries its code (:data:`cxrfl.fl.packaging.PACKAGING`): ``readme``
            (the committed jobs), ``preinstalled`` (no ``app/custom``) or ``byoc`` (the ``cxrfl``
            package copied into ``app/custom``); the old names ``none`` and ``package`` for one more
            release, with a warning.

    Raises:
        ConfigError: a bad job setting (one line naming it).
    """
    custom = packaging(custom, "write_job(custom)")
    if custom not in PACKAGING:
        raise ValueError(f"custom must be one of {PACKAGING}, got {custom!r}")
    spec.recipe(custom="readme" if custom == "readme" else "preinstalled").export(str(out))
    root = Path(out) / spec.name
    if custom == "byoc":
        import cxrfl

        for app in app_dirs(root):
            shutil.copytree(
                Path(cxrfl.__file__).resolve().parent,
                app / "custom" / "cxrfl",
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo"),
            )
    return root


def export_all(out: Path) -> list[Path]:
    """Write every job in :data:`JOBS`.

    Args:
        out: the folder that holds the job folders (``jobs/``).
    """
    return [write_job(spec, Path(out)) for spec in JOBS]


def job_spec(name: str) -> JobSpec:
    """The job of :data:`JOBS` with this name.

    Args:
        name: the job (folder) name.

    Raises:
        KeyError: no such job (the message lists them).
    """
    for spec in JOBS:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown job {name!r}; jobs: {[s.name for s in JOBS]}")
