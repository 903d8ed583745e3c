"""The NVFlare job folders under ``jobs/``, defined in Python.

``cxrfl jobs export --out jobs`` writes them; a test regenerates them and compares with the
committed folders, so the two never drift. Every argument is written explicitly (no reliance
on NVFlare's defaults). Jobs carry no site data: each site reads its own config at run time.
The ``app/custom`` folder holds only a README: the code comes from the installed ``cxrfl``
package (see README, "Deploy across hospitals", for the bring-your-own-code variant).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cxrfl.models import ModelConfig
from cxrfl.training import TrainConfig

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
        executor_args: :class:`cxrfl.fl.executor.SiteExecutor` arguments.
        min_clients: sites needed to start the job.
        resource_spec: per-site resources NVFlare checks before deploying (e.g. GPUs).
        description: one line for meta.json.
    """

    name: str
    controller: str
    controller_args: dict[str, Any]
    executor_args: dict[str, Any] = field(
        default_factory=lambda: {"device": "auto", "num_workers": 0, "num_threads": 0, "analytic_sender_id": "analytic_sender"}
    )
    min_clients: int = 2
    resource_spec: dict[str, Any] = field(default_factory=dict)
    description: str = ""

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
                {"tasks": ["train", "validate"], "executor": {"path": "cxrfl.fl.executor.SiteExecutor", "args": self.executor_args}}
            ],
            "components": [
                {"id": "analytic_sender", "path": "nvflare.app_opt.tracking.tb.tb_writer.TBWriter",
                 "args": {"event_type": ANALYTICS_EVENT}},
                {"id": "event_to_fed", "path": "nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
                 "args": {"events_to_convert": [ANALYTICS_EVENT], "fed_event_prefix": "fed."}},
            ],
            "task_data_filters": [],
            "task_result_filters": [],
        }

    def meta(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "resource_spec": self.resource_spec,
            "deploy_map": {"app": ["@ALL"]},
            "min_clients": self.min_clients,
        }


def surgical_args(model: ModelConfig, train: TrainConfig, **overrides: Any) -> dict[str, Any]:
    """Full argument dict of :class:`cxrfl.fl.controller.SurgicalAggregation`.

    Args:
        model: network settings.
        train: site training settings.
        overrides: other controller arguments.
    """
    args: dict[str, Any] = {
        "num_rounds": 20,
        "min_clients": 2,
        "model_config": model.to_dict(),
        "train_config": train.to_dict(),
        "batchnorm": "fedavg",
        "weighting": "uniform",
        "robust": None,
        "clip_norm": None,
        "patience": 5,
        "min_delta": 1e-4,
        "task_timeout": 0,
        "seed": 0,
        "evaluate_test": True,
        "external_test": None,
        "keep_round_checkpoints": True,
    }
    unknown = set(overrides) - set(args)
    if unknown:
        raise ValueError(f"unknown controller argument(s): {sorted(unknown)}")
    args.update(overrides)
    return args


DEMO_MODEL = ModelConfig(image_size=64)
"""CPU demo setting: 64x64 inputs, trained from scratch (no weights can be downloaded here)."""

DEMO_TRAIN = TrainConfig(lr=1e-3, warmup_lr=5e-3, warmup_epochs=2, local_epochs=1, batch_size=32)
"""CPU demo setting: from-scratch learning rates, short warm-up."""

CLINICAL_MODEL = ModelConfig(image_size=224)
CLINICAL_TRAIN = TrainConfig()

SURGICAL = "cxrfl.fl.controller.SurgicalAggregation"

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
)


def write_job(spec: JobSpec, out: Path) -> Path:
    """Write one job folder.

    Args:
        spec: the job.
        out: parent folder (the job goes to ``out/spec.name``).
    """
    root = out / spec.name
    config = root / "app" / "config"
    config.mkdir(parents=True, exist_ok=True)
    (root / "app" / "custom").mkdir(parents=True, exist_ok=True)

    def dump(path: Path, obj: dict) -> None:
        path.write_text(json.dumps(obj, indent=2) + "\n")

    dump(root / "meta.json", spec.meta())
    dump(config / "config_fed_server.json", spec.server_config())
    dump(config / "config_fed_client.json", spec.client_config())
    (root / "app" / "custom" / "README.md").write_text(CUSTOM_README)
    return root


def export_all(out: Path) -> list[Path]:
    """Write every job in :data:`JOBS`.

    Args:
        out: the folder that holds the job folders (``jobs/``).
    """
    return [write_job(spec, Path(out)) for spec in JOBS]
