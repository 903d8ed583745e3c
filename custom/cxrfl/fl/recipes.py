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
adds experiment tracking (:data:`cxrfl.fl.job_settings.TRACKERS`: each site's per-round metrics and the server's
aggregated ones travel as NVFlare analytics events to TensorBoard and/or MLflow receivers on the
server; nothing per image leaves a site) and the optional privacy filters on what the sites send
back, and optional quantization of every message (:mod:`cxrfl.fl.quantization`). No recipe carries site
data: each site reads its own config when the job starts
(:mod:`cxrfl.fl.site_config`). The job folders under ``jobs/`` are exports of these recipes
(:mod:`cxrfl.jobs`).
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Mapping, Sequence
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

from cxrfl.clinical.pooling import PooledEvaluation
from cxrfl.common.config import Config
from cxrfl.common.privacy import privacy_args
from cxrfl.cwt.config import CWTConfig, RelayConfig
from cxrfl.cwt.relay import TASKS as CWT_TASKS
from cxrfl.errors import ConfigError
from cxrfl.fedeval.config import FedEvalConfig
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.protocol import SSL as FEDFEW_SSL
from cxrfl.fedfew.protocol import TASKS as FEDFEW_TASKS
from cxrfl.fedfew.protocol import TRAIN as FEDFEW_TRAIN
from cxrfl.fl.aggregator import AGGREGATION_POLICY, SurgicalAggregator
from cxrfl.fl.base import TaskController, TaskExecutor, write_every_arg
from cxrfl.fl.cwt import CWTExecutor, CyclicWeightTransfer
from cxrfl.fl.fedeval import FederatedEvaluation
from cxrfl.fl.fedfew import FedFew, FedFewExecutor
from cxrfl.fl.job_settings import ANALYTIC_SENDER, JobSettings
from cxrfl.fl.site_config import DEMO_SITES
from cxrfl.fl.surgical import SurgicalAggregation, SurgicalExecutor
from cxrfl.nn.models import ModelConfig
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import EVALUATION_TASKS
from cxrfl.surgical.host import TASKS as SURGICAL_TASKS

log = logging.getLogger(__name__)

CUSTOM_README = Path(__file__).with_name("job_custom") / "README.md"

FED_EVENT = f"fed.{ANALYTIC_EVENT_TYPE}"

AGGREGATOR_ID = "aggregator"
"""The surgical job's aggregator component (NVFlare's own name for it in ``ScatterAndGather`` jobs)."""

TRAIN_TASK = "train"
"""The training task of surgical aggregation and CWT (a recipe's :attr:`CxrflRecipe.update_tasks`)."""


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
        skip: arguments never written (deprecated ones, or those a job component declares instead).

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
        result_filters: filters on every site's update results (:attr:`update_tasks`) before the privacy filter.
        server_config_files: files shipped in the server's app only (its ``config/`` folder).
        server_components: component id -> (a component of the server's app that the workflow looks up by
            that id, e.g. the surgical job's ``aggregator``; its arguments as JSON values, every one written).
    """

    executor: ClassVar[type[TaskExecutor]]
    tasks: ClassVar[tuple[str, ...]]
    update_tasks: ClassVar[tuple[str, ...]] = (TRAIN_TASK,)
    """The tasks whose results are the site's trained weights: the privacy and result filters see these."""

    def __init__(
        self,
        job: JobSettings,
        controller: type[TaskController],
        args: dict[str, Any],
        result_filters: tuple[Any, ...] = (),
        server_config_files: tuple[Path, ...] = (),
        server_components: Mapping[str, tuple[Any, dict[str, Any]]] | None = None,
    ) -> None:
        self.settings = job
        self.controller_args = args
        self.component_args = {k: v for _, written in (server_components or {}).values() for k, v in written.items()}
        fed_job = FedJob(name=job.name, min_clients=job.min_clients, meta_props={"description": job.description})
        fed_job.set_app_packages(["cxrfl"])  # the code is the installed package, never copied piecemeal
        for comp_id, (component, comp_args) in (server_components or {}).items():
            fed_job.to_server(write_every_arg(component, comp_args), id=comp_id)
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

    @property
    def job_arguments(self) -> dict[str, Any]:
        """Every setting the job writes, by the name the recipe takes it: the workflow's arguments and those of
        the server components it looks up (the surgical job's aggregation policy), component ids left out."""
        ids = {"aggregator_id"} if self.component_args else set()
        return {**{k: v for k, v in self.controller_args.items() if k not in ids}, **self.component_args}

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
        """The sites' filter chains (NVFlare runs one chain per task): the update tasks get the result filters
        and privacy; with ``quantize`` every task also dequantizes first what arrives and quantizes last what
        leaves, and the server quantizes what it sends and dequantizes what it receives."""
        from cxrfl.fl.privacy import UpdatePrivacy

        data: list[Any] = []
        result = list(result_filters)
        if job.privacy is not None:
            # the same class remembers what the site received (data filter) and filters the difference (result)
            privacy = {"method": job.privacy["method"], "args": privacy_args(job.privacy)}
            data.append(write_every_arg(UpdatePrivacy(**privacy), privacy))
            result.append(write_every_arg(UpdatePrivacy(**privacy), privacy))
        updates = [t for t in self.tasks if t in self.update_tasks]
        chains = [(updates, data, result)] if updates else []
        if job.quantize is not None:
            from cxrfl.fl.quantization import ExactDequantizer, ExactQuantizer

            fmt = {"quantization_type": job.quantize}
            chains.append(([t for t in self.tasks if t not in self.update_tasks], [], []))
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
        min_clients: sites needed to start.
        min_results: fewest valid site results that make a round (the same name in every recipe;
            None: ``min_clients``).
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
            selection, resume_from, task_timeout ...). The aggregation policy (``weighting``,
            ``robust``, ``clip_norm``) goes to the job's ``aggregator`` component
            (:class:`cxrfl.fl.aggregator.SurgicalAggregator`), which the workflow looks up by id.
    """

    executor = SurgicalExecutor
    tasks = SURGICAL_TASKS

    def __init__(
        self,
        *,
        name: str = "surgical_agg",
        min_clients: int = _S.min_clients,
        min_results: int | None = None,
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
        policy = SurgicalConfig.from_dict(
            {k: rest.pop(k) for k in AGGREGATION_POLICY if k in rest}, where=f"{name} aggregator"
        )
        aggregator = {k: getattr(policy, k) for k in AGGREGATION_POLICY}
        given = {
            "aggregator_id": AGGREGATOR_ID,
            "num_rounds": num_rounds,
            "min_clients": min_clients if min_results is None else min_results,
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
            skip=AGGREGATION_POLICY,
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
        components = {AGGREGATOR_ID: (SurgicalAggregator(**aggregator), aggregator)}
        super().__init__(job, SurgicalAggregation, args, filters, server_components=components)


class CWTRecipe(CxrflRecipe):
    """Cyclical weight transfer (Balachandar et al. 2020): one model relayed site to site, the four
    optimizations (PLTI, CLR, LWMS, CWL) switched in ``cwt_config``.

    Args:
        name: job name.
        min_clients: sites needed to start.
        min_results: fewest sites that must train in a cycle for it to count (the same name in every
            recipe; the workflow's ``min_sites``, an old name still taken here for one release, with a warning).
        cwt_config: :class:`cxrfl.cwt.config.CWTConfig` (or its fields; None: the paper's base recipe).
        model_config: :class:`cxrfl.nn.models.ModelConfig` (or its fields).
        settings: :class:`JobSettings` fields and every other argument of
            :class:`cxrfl.fl.cwt.CyclicWeightTransfer` (site_order, task_timeout ...).
    """

    executor = CWTExecutor
    tasks = CWT_TASKS

    def __init__(
        self,
        *,
        name: str = "cwt",
        min_clients: int = 2,
        min_results: int = RelayConfig().min_sites,
        cwt_config: CWTConfig | Mapping[str, Any] | None = None,
        model_config: ModelConfig | Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        if "min_sites" in settings:
            log.warning(f"{name}: CWTRecipe(min_sites=...) is deprecated and goes in the next release: use min_results")
            min_results = settings.pop("min_sites")
        job, rest = JobSettings.split({"name": name, "min_clients": min_clients, **settings})
        given = {
            "cwt_config": cwt_config,
            "model_config": model_config,
            "min_sites": min_results,
            "analytic_sender_id": job.sender_id,
            **rest,
        }
        sections = {"cwt_config": CWTConfig, "model_config": ModelConfig, "pooled": PooledEvaluation}
        args = controller_args(CyclicWeightTransfer, given, sections)
        super().__init__(job, CyclicWeightTransfer, args)


class FedFewRecipe(CxrflRecipe):
    """FedFew: federated SimSiam, an energy-based classifier of the common classes, the energy
    threshold and the rare classes' prototypes, in one workflow.

    Args:
        name: job name.
        min_clients: sites needed to start.
        min_results: fewest valid site results that make a round (the same name in every recipe; the
            workflow's ``min_clients``).
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
    update_tasks = (FEDFEW_SSL, FEDFEW_TRAIN)  # the stage-1 and stage-2 weights; statistics and prototypes are not

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
        given = {
            "fedfew_config": fedfew_config,
            "model_config": model_config,
            "min_clients": min_results,
            "analytic_sender_id": job.sender_id,
            **rest,
        }
        args = controller_args(
            FedFew,
            given,
            {"fedfew_config": FedFewConfig, "model_config": ModelConfig, "pooled": PooledEvaluation},
            skip=("resume",),
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

    executor = SurgicalExecutor
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
