"""NVFlare 2.9 recipes of cxrfl's methods: define a job in Python, run it anywhere, export it.

::

    from nvflare.recipe import SimEnv
    from cxrfl.fl.recipes import SurgicalAggregationRecipe

    recipe = SurgicalAggregationRecipe(name="surgical_agg", num_rounds=6, model_config={"image_size": 64})
    recipe.execute(SimEnv(num_clients=2))   # or PocEnv(num_clients=2), ProdEnv(startup_kit_location=...)

``python job.py --export --export-dir DIR`` (``recipe.execute`` reads NVFlare's export flags) writes
the job folder instead. A recipe puts the method's workflow (a :class:`cxrfl.fl.base.TaskController`)
on the server and its executor on every site, writes every argument into the job (NVFlare's
exporter otherwise drops arguments equal to their defaults: :func:`cxrfl.fl.base.write_every_arg`),
adds experiment tracking (:data:`TRACKERS`: each site's per-round metrics and the server's
aggregated ones travel as NVFlare analytics events to TensorBoard and/or MLflow receivers on the
server; nothing per image leaves a site) and the optional privacy filters on what the sites send
back, and optional quantization of every message (:mod:`cxrfl.fl.quantization`). No recipe carries site
data: each site reads its own config when the job starts
(:mod:`cxrfl.fl.site_config`). The job folders under ``jobs/`` are exports of these recipes
(:mod:`cxrfl.jobs`).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE
from nvflare.apis.job_def import ALL_SITES, JobMetaKey
from nvflare.app_common.filters.exclude_vars import ExcludeVars
from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent
from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
from nvflare.app_opt.tracking.tb.tb_writer import TBWriter
from nvflare.job_config.api import FedJob
from nvflare.job_config.defs import FilterType
from nvflare.recipe.spec import Recipe
from nvflare.recipe.utils import set_recipe_meta
from nvflare.utils.job_launcher_utils import validate_portable_resource_spec

from cxrfl.clinical.pooling import PooledEvaluation
from cxrfl.common.config import Config
from cxrfl.common.privacy import check_privacy, privacy_args
from cxrfl.cwt.config import CWTConfig
from cxrfl.cwt.relay import TASKS as CWT_TASKS
from cxrfl.data.dataset import resolve_workers
from cxrfl.errors import ConfigError
from cxrfl.fedeval.config import FedEvalConfig
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.protocol import TASKS as FEDFEW_TASKS
from cxrfl.fl.base import TaskController, TaskExecutor, write_every_arg
from cxrfl.fl.cwt import CWTExecutor, CyclicWeightTransfer
from cxrfl.fl.fedeval import FederatedEvaluation
from cxrfl.fl.fedfew import FedFew, FedFewExecutor
from cxrfl.fl.resources import DEFAULT_KEY, PORTABLE_KEYS
from cxrfl.fl.site_config import DEMO_SITES
from cxrfl.fl.surgical import SiteExecutor, SurgicalAggregation
from cxrfl.nn.models import ModelConfig
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import EVALUATION_TASKS
from cxrfl.surgical.host import TASKS as SURGICAL_TASKS

TRACKERS = ("tensorboard", "mlflow")
"""Experiment trackers a recipe can send metrics to (both at once is fine)."""

QUANTIZE_TYPES = ("float16", "blockwise8", "float4", "normfloat4")
"""NVFlare's quantization formats a job's ``quantize`` may name (:mod:`cxrfl.fl.quantization`)."""

CUSTOM_MODES = ("readme", "none")
"""What a recipe's ``app/custom`` holds: ``readme`` (only a README: NVFlare counts the job as
bring-your-own-code, so a simulator or a site without ``cxrfl.`` in its ``class_allow_list`` runs
it; the code is the installed package) or ``none`` (no folder: for sites that pre-install cxrfl
and allow ``cxrfl.``). ``cxrfl deploy job --mode byoc`` copies the package itself in."""

CUSTOM_README = Path(__file__).with_name("job_custom") / "README.md"

ANALYTIC_SENDER = "analytic_sender"
"""Component id of the analytics writer on the server and on every site."""

FED_EVENT = f"fed.{ANALYTIC_EVENT_TYPE}"

TRAIN_TASK = "train"
"""The task whose results the privacy and BatchNorm filters see."""


@dataclass(frozen=True)
class JobSettings(Config):
    """What every cxrfl recipe takes beside its method's settings.

    Args:
        name: job name (and the folder an export writes).
        min_clients: sites that must be connected for the job to start (``meta.json``).
        description: one line for ``meta.json``.
        resources: what every site must offer before NVFlare gives it the job (``resource_spec``'s
            ``@default``): ``num_of_gpus``, ``num_of_cpus``, ``memory`` (``"32Gi"``); see
            :mod:`cxrfl.fl.resources`.
        site_resources: one site's request over ``resources`` (``{"hospital-a": {"num_of_gpus": 2}}``),
            which may also name keys of that site's resource manager (``mem_per_gpu_in_GiB``).
        device: the sites' torch device: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:N``.
        num_workers: data-loader worker processes per site loader, or ``auto`` (one per core the
            site process is given, less one; :func:`cxrfl.data.dataset.resolve_workers`).
        num_threads: CPU threads per site (0: every core the site process is given).
        tracking: experiment trackers (:data:`TRACKERS`); empty: none.
        tracking_uri: MLflow tracking server (``http://host:5000``, ``sqlite:///path.db``); None: an
            SQLite store ``mlflow.db`` in the job's server workspace folder (no server needed).
        privacy: None (off), or ``{"method": "percentile" | "svt", "args": {...}}``: NVFlare's
            ``PercentilePrivacy`` / ``SVTPrivacy`` on every ``train`` result, applied to the weight
            difference by :class:`cxrfl.fl.privacy.UpdatePrivacy` (checked, and its missing args
            written explicitly, by :mod:`cxrfl.common.privacy`).
        quantize: None (off), or an NVFlare quantization format of :data:`QUANTIZE_TYPES` for what the
            server sends and the sites return, BatchNorm statistics and integer arrays kept exact
            (:mod:`cxrfl.fl.quantization`; needs ``pip install 'cxrfl[quantization]'``).
        custom: what ``app/custom`` holds (:data:`CUSTOM_MODES`).
        sites: the client sites by name. Named: the server's app (``config_fed_server.json``) goes to
            the server alone and each named site gets a client app; empty: one app to NVFlare's
            ``@ALL`` (the server and every site, so every site also receives the server's config).
    """

    SECTION: ClassVar[str] = "job"
    name: str
    min_clients: int = field(default=2, metadata={"ge": 1})
    description: str = ""
    resources: dict[str, Any] = field(default_factory=dict)
    site_resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    device: str = "auto"
    num_workers: int | str = 0
    num_threads: int = field(default=1, metadata={"ge": 0})
    tracking: tuple[str, ...] = ("tensorboard",)
    tracking_uri: str | None = None
    privacy: dict[str, Any] | None = None
    quantize: str | None = field(default=None, metadata={"choices": QUANTIZE_TYPES})
    custom: str = field(default="readme", metadata={"choices": CUSTOM_MODES})
    sites: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(set(self.sites)) != len(self.sites) or any(not s or s in ("server", ALL_SITES) for s in self.sites):
            self.fail(
                "sites", f"must list distinct client site names (not 'server' or '{ALL_SITES}'), got {list(self.sites)}"
            )
        bad = [t for t in self.tracking if t not in TRACKERS]
        if bad or len(set(self.tracking)) != len(self.tracking):
            self.fail("tracking", f"must list distinct trackers of {list(TRACKERS)}, got {list(self.tracking)}")
        if self.tracking_uri is not None and "mlflow" not in self.tracking:
            self.fail("tracking_uri", "is MLflow's; add 'mlflow' to tracking")
        if "mlflow" in self.tracking and importlib.util.find_spec("mlflow") is None:
            self.fail("tracking", "'mlflow' needs MLflow: pip install 'cxrfl[mlflow]' (or leave 'mlflow' out)")
        if self.quantize is not None and importlib.util.find_spec("bitsandbytes") is None:
            self.fail("quantize", "needs bitsandbytes: pip install 'cxrfl[quantization]' (or leave quantize unset)")
        resolve_workers(self.num_workers)  # ConfigError naming num_workers
        check_privacy(self.privacy, f"job {self.name}")  # refuses update-destroying settings, warns about lossy ones
        self._check_resources()

    def _check_resources(self) -> None:
        """``resources`` and ``site_resources`` as NVFlare 2.9 reads them (its own validation), else one line."""
        bad = [s for s in self.site_resources if s.startswith("@") or s == "server"]
        if bad:
            self.fail(
                "site_resources",
                f"must be keyed by client site names, got {bad}; a request of every site "
                f"goes in resources (NVFlare's '{DEFAULT_KEY}')",
            )
        unknown = [s for s in self.site_resources if self.sites and s not in self.sites]
        if unknown:
            self.fail("site_resources", f"names {unknown}, not among the job's sites {list(self.sites)}")
        every_site = f" (it holds {list(PORTABLE_KEYS)}; a key of one site's resource manager goes in site_resources)"
        for key, spec, hint in (
            ("resources", {DEFAULT_KEY: self.resources}, every_site),
            ("site_resources", self.resource_spec, ""),
        ):
            try:
                validate_portable_resource_spec(spec)
            except ValueError as exc:
                self.fail(key, f"is not what NVFlare 2.9 reads: {exc}{hint}")

    @property
    def resource_spec(self) -> dict[str, dict[str, Any]]:
        """``meta.json``'s ``resource_spec``: ``resources`` as ``@default``, then each site's own request."""
        every = {DEFAULT_KEY: dict(self.resources)} if self.resources else {}
        return {**every, **{site: dict(spec) for site, spec in self.site_resources.items()}}

    @classmethod
    def split(cls, settings: Mapping[str, Any]) -> tuple[JobSettings, dict[str, Any]]:
        """The job settings among a recipe's keyword arguments, and the rest (the method's).

        Args:
            settings: the recipe's keyword arguments.
        """
        own = {f.name for f in fields(cls)}
        if "resource_spec" in settings:
            raise ConfigError(
                f"{cls.qualified('resource_spec')} is replaced by resources (every site: NVFlare's "
                f"'{DEFAULT_KEY}') and site_resources (one site's own), as NVFlare 2.9 reads them"
            )
        return (
            cls.from_dict({k: v for k, v in settings.items() if k in own}, where="the recipe's arguments"),
            {k: v for k, v in settings.items() if k not in own},
        )

    @property
    def sender_id(self) -> str:
        """The analytics writer's component id ("" when nothing is tracked)."""
        return ANALYTIC_SENDER if self.tracking else ""


def controller_args(
    controller: type[TaskController],
    given: Mapping[str, Any],
    sections: Mapping[str, type[Config]],
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Every argument of a workflow as JSON values: the given ones, the rest at their defaults.

    Args:
        controller: the workflow class.
        given: the arguments set.
        sections: arguments that are settings sections (a ``Config``, its fields or None), written
            in full.
        skip: deprecated arguments never written.

    Raises:
        ConfigError: an argument the workflow does not take.
    """
    params = [
        p for p in inspect.signature(controller.__init__).parameters.values() if p.name != "self" and p.name not in skip
    ]
    unknown = sorted(set(given) - {p.name for p in params})
    if unknown:
        raise ConfigError(
            f"unknown {controller.__name__} argument(s) {unknown}; known: {sorted(p.name for p in params)}"
        )
    args = {p.name: given.get(p.name, p.default) for p in params}
    for key, section in sections.items():
        args[key] = section.from_dict(args[key], where=f"{controller.__name__} {key}").to_dict()
    return json.loads(json.dumps(args))  # tuples as lists: what the job file holds


def _to_sites(fed_job: FedJob, job: JobSettings, component: Any, **kwargs: Any) -> None:
    """Put a component into every site's app: each named site's own (``job.sites``), else NVFlare's ``@ALL`` app.

    Args:
        fed_job: the job.
        job: the job settings.
        component: the component (its configuration is written into each app).
        kwargs: ``FedJob.to``'s options (``tasks``, ``id``, ``filter_type``).
    """
    for target in job.sites or (ALL_SITES,):
        fed_job.to(component, target, **kwargs)


def batchnorm_state_keys(model: ModelConfig) -> list[str]:
    """Every BatchNorm state-dict entry of the network (selected by module type, not by name).

    Args:
        model: the network settings (``pretrained`` is ignored: names do not depend on weights).
    """
    from cxrfl.nn.models import batchnorm_keys, build_model

    return batchnorm_keys(build_model(ModelConfig.from_dict({**model.to_dict(), "pretrained": None}), 1))


class CxrflRecipe(Recipe):
    """Base of the cxrfl recipes: one workflow on the server, one executor on every site.

    Args:
        job: the job settings.
        controller: the workflow class.
        args: its arguments (every one, as JSON values: :func:`controller_args`).
        result_filters: filters on every site's ``train`` results before the privacy filter.
        server_config_files: files shipped in the server's app only (its ``config/`` folder).
    """

    executor: ClassVar[type[TaskExecutor]]
    tasks: ClassVar[tuple[str, ...]]

    def __init__(
        self,
        job: JobSettings,
        controller: type[TaskController],
        args: dict[str, Any],
        result_filters: tuple[Any, ...] = (),
        server_config_files: tuple[Path, ...] = (),
    ) -> None:
        self.settings = job
        self.controller_args = args
        fed_job = FedJob(name=job.name, min_clients=job.min_clients, meta_props={"description": job.description})
        fed_job.set_app_packages(["cxrfl"])  # the code is the installed package, never copied piecemeal
        fed_job.to_server(write_every_arg(controller(**args), args), id="controller")
        site = {
            "device": job.device,
            "num_workers": job.num_workers,
            "num_threads": job.num_threads,
            "analytic_sender_id": job.sender_id,
        }
        _to_sites(fed_job, job, write_every_arg(self.executor(**site), site), tasks=list(self.tasks))
        if job.tracking:
            self._add_tracking(fed_job, job)
        self._add_filters(fed_job, job, result_filters)
        if job.custom == "readme":
            fed_job.add_file_to_server(str(CUSTOM_README))
        for path in server_config_files:
            fed_job.add_file_to_server(str(path), app_folder_type="config")
        super().__init__(fed_job)
        if job.resource_spec:  # NVFlare refuses an empty one here; the exporter then writes {}
            set_recipe_meta(self, JobMetaKey.RESOURCE_SPEC, job.resource_spec)

    @staticmethod
    def _add_tracking(fed_job: FedJob, job: JobSettings) -> None:
        """Sites and server write NVFlare analytics events; the server's receivers store them."""
        fed_job.to_server(write_every_arg(TBWriter(event_type=ANALYTIC_EVENT_TYPE)), id=ANALYTIC_SENDER)
        _to_sites(fed_job, job, write_every_arg(TBWriter(event_type=ANALYTIC_EVENT_TYPE)), id=ANALYTIC_SENDER)
        _to_sites(
            fed_job,
            job,
            write_every_arg(ConvertToFedEvent(events_to_convert=[ANALYTIC_EVENT_TYPE], fed_event_prefix="fed.")),
            id="event_to_fed",
        )
        events = [FED_EVENT, ANALYTIC_EVENT_TYPE]  # the sites' and the server's own
        if "tensorboard" in job.tracking:
            fed_job.to_server(
                write_every_arg(TBAnalyticsReceiver(tb_folder="tb_events", events=events)), id="tb_receiver"
            )
        if "mlflow" in job.tracking:
            from cxrfl.fl.tracking import MLflowReceiver

            receiver = MLflowReceiver(
                tracking_uri=job.tracking_uri,
                events=events,
                kw_args={"experiment_name": job.name, "run_name": job.name, "experiment_tags": {}, "run_tags": {}},
            )
            fed_job.to_server(write_every_arg(receiver), id="mlflow_receiver")

    def _add_filters(self, fed_job: FedJob, job: JobSettings, result_filters: tuple[Any, ...]) -> None:
        """The sites' filter chains (NVFlare runs one chain per task): ``train`` gets the result filters and
        privacy; with ``quantize`` every task also dequantizes first what arrives and quantizes last what leaves,
        and the server quantizes what it sends and dequantizes what it receives."""
        from cxrfl.fl.privacy import UpdatePrivacy

        data: list[Any] = []
        result = list(result_filters)
        if job.privacy is not None:
            # the same class remembers what the site received (data filter) and filters the difference (result)
            privacy = {"method": job.privacy["method"], "args": privacy_args(job.privacy)}
            data.append(write_every_arg(UpdatePrivacy(**privacy), privacy))
            result.append(write_every_arg(UpdatePrivacy(**privacy), privacy))
        chains = [([TRAIN_TASK], data, result)] if TRAIN_TASK in self.tasks else []
        if job.quantize is not None:
            from cxrfl.fl.quantization import ExactDequantizer, ExactQuantizer

            fmt = {"quantization_type": job.quantize}
            chains.append(([t for t in self.tasks if t != TRAIN_TASK], [], []))
            for _, into_site, out_of_site in chains:
                into_site.insert(0, write_every_arg(ExactDequantizer(), {}))
                out_of_site.append(write_every_arg(ExactQuantizer(**fmt), fmt))
            every = list(self.tasks)
            fed_job.to_server(
                write_every_arg(ExactQuantizer(**fmt), fmt), filter_type=FilterType.TASK_DATA, tasks=every
            )
            fed_job.to_server(write_every_arg(ExactDequantizer(), {}), filter_type=FilterType.TASK_RESULT, tasks=every)
        for tasks, into_site, out_of_site in chains:
            for kind, filters in ((FilterType.TASK_DATA, into_site), (FilterType.TASK_RESULT, out_of_site)):
                for site_filter in filters if tasks else ():
                    _to_sites(fed_job, job, site_filter, filter_type=kind, tasks=tasks)


_S = SurgicalConfig()


class SurgicalAggregationRecipe(CxrflRecipe):
    """Surgical aggregation (or one of the papers' baselines, by ``head_mode``/``missing``/``batchnorm``).

    ==============================  =========================================================
    method                          arguments
    ==============================  =========================================================
    surgical aggregation            ``head_mode="surgical"`` (FedAvg feature extractor)
    ... with FedBN / FedBN+         ``batchnorm="fedbn"`` / ``"fedbn+"``
    vanilla FL                      ``head_mode="union", missing="negative"``
    FL with partial loss            ``head_mode="union", missing="ignore"``
    personalized FL (+ FedBN)       ``head_mode="local"`` (``batchnorm="fedbn"``)
    ==============================  =========================================================

    Args:
        name: job name.
        min_clients: sites needed to start, and fewest valid results that make a round.
        num_rounds: most federated rounds after the head warm-up.
        model_config: :class:`cxrfl.nn.models.ModelConfig` (or its fields; None: defaults).
        train_config: :class:`cxrfl.nn.training.TrainConfig` (or its fields), sent to the sites.
        head_mode: ``surgical``, ``union`` or ``local``.
        missing: ``negative`` or ``ignore`` (union heads).
        batchnorm: ``fedavg``, ``fedbn`` or ``fedbn+``.
        exclude_batchnorm: NVFlare's ``ExcludeVars`` on every site's results naming every BatchNorm
            entry, so none leaves a site (FedBN/FedBN+ only).
        settings: :class:`JobSettings` fields (device, tracking, privacy ...) and every other
            argument of :class:`cxrfl.fl.surgical.SurgicalAggregation` (patience, min_delta,
            weighting, robust, resume_from, task_timeout ...).
    """

    executor = SiteExecutor
    tasks = SURGICAL_TASKS

    def __init__(
        self,
        *,
        name: str = "surgical_agg",
        min_clients: int = _S.min_clients,
        num_rounds: int = _S.num_rounds,
        model_config: ModelConfig | Mapping[str, Any] | None = None,
        train_config: TrainConfig | Mapping[str, Any] | None = None,
        head_mode: str = _S.head_mode,
        missing: str = _S.missing,
        batchnorm: str = _S.batchnorm,
        exclude_batchnorm: bool = False,
        **settings: Any,
    ) -> None:
        job, rest = JobSettings.split({"name": name, "min_clients": min_clients, **settings})
        given = {
            "num_rounds": num_rounds,
            "min_clients": min_clients,
            "model_config": model_config,
            "train_config": train_config,
            "head_mode": head_mode,
            "missing": missing,
            "batchnorm": batchnorm,
            "analytic_sender_id": job.sender_id,
            **rest,
        }
        args = controller_args(
            SurgicalAggregation,
            given,
            {"model_config": ModelConfig, "train_config": TrainConfig, "pooled": PooledEvaluation},
        )
        filters: tuple[Any, ...] = ()
        if exclude_batchnorm:
            if args["batchnorm"] == "fedavg":
                raise ConfigError(
                    f"{name}: exclude_batchnorm needs batchnorm 'fedbn' or 'fedbn+' (FedAvg averages "
                    "BatchNorm, so the server needs it from every site)"
                )
            keys = batchnorm_state_keys(ModelConfig.from_dict(args["model_config"]))
            filters = (write_every_arg(ExcludeVars(exclude_vars=keys)),)
        super().__init__(job, SurgicalAggregation, args, filters)


class CWTRecipe(CxrflRecipe):
    """Cyclical weight transfer (Balachandar et al. 2020): one model relayed site to site, the four
    optimizations (PLTI, CLR, LWMS, CWL) switched in ``cwt_config``.

    Args:
        name: job name.
        min_clients: sites needed to start.
        cwt_config: :class:`cxrfl.cwt.config.CWTConfig` (or its fields; None: the paper's base recipe).
        model_config: :class:`cxrfl.nn.models.ModelConfig` (or its fields).
        settings: :class:`JobSettings` fields and every other argument of
            :class:`cxrfl.fl.cwt.CyclicWeightTransfer` (site_order, min_sites, task_timeout ...).
    """

    executor = CWTExecutor
    tasks = CWT_TASKS

    def __init__(
        self,
        *,
        name: str = "cwt",
        min_clients: int = 2,
        cwt_config: CWTConfig | Mapping[str, Any] | None = None,
        model_config: ModelConfig | Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        job, rest = JobSettings.split({"name": name, "min_clients": min_clients, **settings})
        given = {"cwt_config": cwt_config, "model_config": model_config, "analytic_sender_id": job.sender_id, **rest}
        args = controller_args(CyclicWeightTransfer, given, {"cwt_config": CWTConfig, "model_config": ModelConfig})
        super().__init__(job, CyclicWeightTransfer, args)


class FedFewRecipe(CxrflRecipe):
    """FedFew: federated SimSiam, an energy-based classifier of the common classes, the energy
    threshold and the rare classes' prototypes, in one workflow.

    Args:
        name: job name.
        min_clients: sites needed to start.
        min_results: fewest valid site results that make a round (the workflow's ``min_clients``).
        sites: the client sites by name (required: FedFew's server config, e.g. ``fedfew_config.uc_classes``,
            must reach the server only, and NVFlare 2.9 can send a client app to all sites but the
            server only by naming them; see :class:`JobSettings`).
        fedfew_config: :class:`cxrfl.fedfew.config.FedFewConfig` (or its fields).
        model_config: :class:`cxrfl.nn.models.ModelConfig` (or its fields).
        settings: :class:`JobSettings` fields and every other argument of
            :class:`cxrfl.fl.fedfew.FedFew` (task_timeout, resume_from, evaluate_test ...).
    """

    executor = FedFewExecutor
    tasks = FEDFEW_TASKS

    def __init__(
        self,
        *,
        name: str = "fedfew",
        min_clients: int = 2,
        min_results: int = 1,
        sites: Sequence[str] = DEMO_SITES,
        fedfew_config: FedFewConfig | Mapping[str, Any] | None = None,
        model_config: ModelConfig | Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        job, rest = JobSettings.split({"name": name, "min_clients": min_clients, "sites": tuple(sites), **settings})
        if not job.sites:
            raise ConfigError(
                f"{name}: name the sites (sites=[...]): FedFew's server config must reach the server "
                "only, and an unnamed set of sites gets the server's app too (NVFlare's @ALL)"
            )
        if job.privacy is not None:  # its filters see the ``train`` task only; FedFew's tasks are named otherwise
            raise ConfigError(
                f"{name}: privacy filters are not available for FedFew yet (its update tasks are not wired to "
                "them, so the setting would silently do nothing); leave privacy unset"
            )
        given = {
            "fedfew_config": fedfew_config,
            "model_config": model_config,
            "min_clients": min_results,
            "analytic_sender_id": job.sender_id,
            **rest,
        }
        args = controller_args(
            FedFew, given, {"fedfew_config": FedFewConfig, "model_config": ModelConfig}, skip=("resume",)
        )
        super().__init__(job, FedFew, args)


class FedEvalRecipe(CxrflRecipe):
    """Evaluation only (NVFlare's ``FedEvalRecipe`` for class-heterogeneous sites): a trained model scored at
    every site from binned score counts, nothing trained (:mod:`cxrfl.fedeval`).

    Args:
        model: the checkpoint to evaluate: a file, shipped in the server's app (``config/``) and named there
            by its file name; with ``ship_model=False`` the plain name of one in the server's
            ``$CXRFL_MODEL_ROOT``.
        name: job name.
        min_clients: sites needed to start.
        sites: the client sites by name (required: the model, whose class list names every site's
            classes, must reach the server only; see :class:`FedFewRecipe`).
        fedeval_config: :class:`cxrfl.fedeval.config.FedEvalConfig` (or its fields).
        ship_model: put ``model`` into the job (False: the server's operator holds it).
        settings: :class:`JobSettings` fields and ``task_timeout``.
    """

    executor = SiteExecutor
    tasks = EVALUATION_TASKS

    def __init__(
        self,
        *,
        model: str | Path,
        name: str = "fedeval",
        min_clients: int = 2,
        sites: Sequence[str] = DEMO_SITES,
        fedeval_config: FedEvalConfig | Mapping[str, Any] | None = None,
        ship_model: bool = True,
        **settings: Any,
    ) -> None:
        job, rest = JobSettings.split(
            {"name": name, "min_clients": min_clients, "sites": tuple(sites), "tracking": (), **settings}
        )
        if not job.sites:
            raise ConfigError(
                f"{name}: name the sites (sites=[...]): the model must reach the server only, and "
                "an unnamed set of sites gets the server's app too (NVFlare's @ALL)"
            )
        if job.quantize is not None:
            job.fail(
                "quantize", "must be unset for an evaluation: the sites would score another model than the one given"
            )
        path = Path(model)
        if ship_model and not path.is_file():
            raise ConfigError(f"{name}: model {str(model)!r} is not a file; give the checkpoint to evaluate")
        given = {"model": path.name, "fedeval_config": fedeval_config, "analytic_sender_id": job.sender_id, **rest}
        args = controller_args(FederatedEvaluation, given, {"fedeval_config": FedEvalConfig})
        super().__init__(job, FederatedEvaluation, args, server_config_files=(path,) if ship_model else ())


def add_run_arguments(parser: Any, quantize: bool = True) -> None:
    """The arguments every ``job.py`` shares: tracking, quantization, and where to run (NVFlare's environments).

    Args:
        parser: an ``argparse.ArgumentParser``.
        quantize: offer ``--quantize`` (training jobs).
    """
    parser.add_argument(
        "--tracking",
        default=("tensorboard",),
        type=lambda text: tuple(t for t in text.split(",") if t),
        help="comma-separated trackers of " + ", ".join(TRACKERS) + " ('' for none)",
    )
    parser.add_argument(
        "--tracking_uri",
        default=None,
        help="MLflow tracking server (default: an SQLite file mlflow.db in the job's server folder)",
    )
    parser.add_argument("--num_threads", type=int, default=1, help="CPU threads per site (0: all it is given)")
    if quantize:
        parser.add_argument(
            "--quantize",
            choices=QUANTIZE_TYPES,
            default=None,
            help="quantize what the server sends and the sites return (default: off; BatchNorm statistics stay exact)",
        )
    env = parser.add_argument_group("where to run")
    env.add_argument(
        "--env",
        choices=("sim", "poc", "prod"),
        default="sim",
        help="simulator (default), a local POC federation, or a provisioned deployment",
    )
    env.add_argument(
        "--n_clients",
        type=int,
        default=2,
        help="sites to simulate (site-1, site-2, ...: the embedded demo hospitals) or to start in POC",
    )
    env.add_argument(
        "--clients",
        default=None,
        help="comma-separated site names instead (data: $CXRFL_SITE_CONFIG_DIR/<site>.yaml or site_configs/)",
    )
    env.add_argument("--threads", type=int, default=None, help="simulator threads (default: one per site)")
    env.add_argument("--workspace", default="/tmp/nvflare/simulation", help="simulator workspace root")
    env.add_argument("--startup_kit", default=None, help="prod: the admin's startup kit folder")
    env.add_argument("--username", default="admin@nvidia.com", help="poc/prod: the submitting admin")


def env_from_args(args: Any) -> Any:
    """The NVFlare execution environment :func:`add_run_arguments` describes.

    Args:
        args: the parsed arguments.
    """
    from nvflare.recipe import PocEnv, ProdEnv, SimEnv

    clients = [c for c in (args.clients or "").split(",") if c] or None
    if args.env == "sim":
        return SimEnv(
            num_clients=0 if clients else args.n_clients,
            clients=clients,
            num_threads=args.threads,
            workspace_root=args.workspace,
        )
    if args.env == "poc":
        return PocEnv(num_clients=len(clients) if clients else args.n_clients, clients=clients, username=args.username)
    if not args.startup_kit:
        raise SystemExit("--env prod needs --startup_kit (the admin's startup kit folder)")
    return ProdEnv(startup_kit_location=args.startup_kit, username=args.username)


def run_recipe(recipe: Recipe, args: Any) -> None:
    """Run (or, with NVFlare's ``--export --export-dir DIR``, export) a recipe and say where the results are.

    Args:
        recipe: the recipe.
        args: arguments of :func:`add_run_arguments`.
    """
    run = recipe.execute(env_from_args(args))
    print(f"job {run.get_job_id()}: status {run.get_status()}; results in {run.get_result()}")
