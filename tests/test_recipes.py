"""The recipes (cxrfl.fl.recipes): NVFlare recipes with validated arguments, the tracking switch,
and the metrics the sites and the server track (fast; the simulator runs are in test_recipes_sim.py)."""

from __future__ import annotations

import json
import math

import pytest
from cwt_helpers import tiny_site
from cxrfl.common.server import ServerLoop
from cxrfl.errors import ConfigError
from cxrfl.fl.base import mean_over_sites, track, write_every_arg
from cxrfl.fl.recipes import CWTRecipe, FedFewRecipe, SurgicalAggregationRecipe
from cxrfl.jobs import app_dirs
from nvflare.recipe.spec import Recipe


def export(recipe, tmp_path) -> dict[str, dict]:
    recipe.export(str(tmp_path))
    apps = app_dirs(tmp_path / recipe.name)  # "app", or "app_server" and one app per named site
    return {
        "server": json.loads((apps[0] / "config" / "config_fed_server.json").read_text()),
        "client": json.loads((apps[-1] / "config" / "config_fed_client.json").read_text()),
        "meta": json.loads((tmp_path / recipe.name / "meta.json").read_text()),
    }


def test_recipes_are_nvflare_recipes_whose_arguments_land_in_the_job(tmp_path):
    recipe = SurgicalAggregationRecipe(
        name="vanilla",
        num_rounds=3,
        head_mode="union",
        missing="negative",
        model_config={"image_size": 64},
        train_config={"lr": 1e-3},
        patience=2,
        min_clients=3,
        description="d",
        num_threads=2,
    )
    assert isinstance(recipe, Recipe)
    job = export(recipe, tmp_path)
    args = job["server"]["workflows"][0]["args"]
    assert (args["num_rounds"], args["head_mode"], args["missing"], args["patience"], args["min_clients"]) == (
        3,
        "union",
        "negative",
        2,
        3,
    )
    assert args["model_config"]["image_size"] == 64 and args["model_config"]["arch"] == "densenet121"  # in full
    assert args["train_config"]["lr"] == 1e-3 and args["train_config"]["warmup_epochs"] == 15
    assert job["meta"]["min_clients"] == 3 and job["meta"]["description"] == "d"
    assert job["client"]["executors"][0]["executor"]["args"]["num_threads"] == 2
    cwt = export(CWTRecipe(name="c", cwt_config={"clr": True}, min_results=2), tmp_path)["server"]["workflows"][0][
        "args"
    ]
    assert cwt["cwt_config"]["clr"] is True and cwt["min_sites"] == 2
    fedfew = export(FedFewRecipe(name="f", min_results=2, fedfew_config={"rounds": 3}), tmp_path)
    assert fedfew["server"]["workflows"][0]["args"]["min_clients"] == 2 and fedfew["meta"]["min_clients"] == 2
    assert fedfew["server"]["workflows"][0]["args"]["fedfew_config"]["rounds"] == 3


def test_every_recipe_names_its_round_quorum_min_results(tmp_path, caplog):
    # issue 43 point 4: the quorum was min_clients (surgical), min_sites (CWT) and min_results (FedFew)
    def workflow(recipe):
        return export(recipe, tmp_path)["server"]["workflows"][0]["args"]

    surgical = workflow(SurgicalAggregationRecipe(name="s", min_clients=3, min_results=2))
    assert surgical["min_clients"] == 2  # SurgicalAggregation's quorum (the job still needs 3 sites to start)
    assert workflow(SurgicalAggregationRecipe(name="s", min_clients=3))["min_clients"] == 3  # None: min_clients
    assert workflow(CWTRecipe(name="c", min_results=2))["min_sites"] == 2
    assert workflow(FedFewRecipe(name="f", min_results=2))["min_clients"] == 2
    assert workflow(CWTRecipe(name="c", min_sites=2))["min_sites"] == 2  # the old name, one more release
    assert any(
        "min_sites=...) is deprecated" in r.getMessage() and "min_results" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: SurgicalAggregationRecipe(num_rounds=-1), "surgical.num_rounds must be >= 0"),
        (lambda: SurgicalAggregationRecipe(paitence=3), r"unknown SurgicalAggregation argument\(s\) \['paitence'\]"),
        (lambda: SurgicalAggregationRecipe(head_mode="all"), "surgical.head_mode must be one of"),
        (lambda: SurgicalAggregationRecipe(exclude_batchnorm=True), "exclude_batchnorm needs batchnorm"),
        (
            lambda: SurgicalAggregationRecipe(tracking=("tensorboard", "wandb")),
            "job.tracking must list distinct trackers",
        ),
        (lambda: SurgicalAggregationRecipe(tracking_uri="http://x:5000"), "job.tracking_uri is MLflow's"),
        (lambda: SurgicalAggregationRecipe(num_workers=-1), "num_workers must be 'auto' or an integer >= 0"),
        (lambda: SurgicalAggregationRecipe(privacy={"method": "dp"}), "privacy method must be one of"),
        (lambda: CWTRecipe(cwt_config={"task": "detect"}), "task must be one of"),
        (lambda: FedFewRecipe(model_config={"image_size": 8}), "model.image_size must be >= 32"),
    ],
)
def test_bad_recipe_arguments_fail_at_construction_naming_the_setting(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def _components(part: dict) -> dict[str, dict]:
    return {c["id"]: c for c in part.get("components", [])}


def test_tracking_is_switched_in_the_recipe(tmp_path):
    off = export(SurgicalAggregationRecipe(name="off", tracking=()), tmp_path / "off")
    assert set(_components(off["server"])) == {"aggregator"} and _components(off["client"]) == {}  # no tracking
    assert off["server"]["workflows"][0]["args"]["analytic_sender_id"] == ""
    assert off["client"]["executors"][0]["executor"]["args"]["analytic_sender_id"] == ""

    both = export(
        SurgicalAggregationRecipe(
            name="both", tracking=("tensorboard", "mlflow"), tracking_uri="http://mlflow.example:5000"
        ),
        tmp_path / "both",
    )
    server, client = _components(both["server"]), _components(both["client"])
    events = ["fed.analytix_log_stats", "analytix_log_stats"]  # the sites' events and the server's own
    assert server["tb_receiver"]["args"] == {"tb_folder": "tb_events", "events": events}
    assert server["mlflow_receiver"]["path"] == "cxrfl.fl.tracking.MLflowReceiver"
    assert server["mlflow_receiver"]["args"]["tracking_uri"] == "http://mlflow.example:5000"
    assert server["mlflow_receiver"]["args"]["events"] == events
    assert (
        server["analytic_sender"]["path"]
        == client["analytic_sender"]["path"]
        == ("nvflare.app_opt.tracking.tb.tb_writer.TBWriter")
    )
    assert client["event_to_fed"]["args"] == {"events_to_convert": ["analytix_log_stats"], "fed_event_prefix": "fed."}
    assert both["server"]["workflows"][0]["args"]["analytic_sender_id"] == "analytic_sender"

    mlflow_only = _components(
        export(SurgicalAggregationRecipe(name="m", tracking=("mlflow",)), tmp_path / "m")["server"]
    )
    assert "tb_receiver" not in mlflow_only and mlflow_only["mlflow_receiver"]["args"]["tracking_uri"] is None


def test_mean_over_sites_leaves_out_missing_and_undefined_values():
    sites = {
        "a": {"loss": 1.0, "auroc": {"X": 0.5, "Y": None}},
        "b": {"loss": 3.0, "auroc": {"X": 0.9}},
        "c": {"loss": math.nan},
        "d": None,
    }
    assert mean_over_sites(sites, ["loss"], per_class="auroc") == pytest.approx({"loss": 2.0, "auroc/X": 0.7})


def test_the_workflows_track_their_aggregated_metrics():
    from cxrfl.fl.cwt import CyclicWeightTransfer
    from cxrfl.fl.fedfew import FedFew
    from cxrfl.fl.surgical import SurgicalAggregation

    record = {
        "round": 2,
        "phase": "train",
        "sites_aggregated": ["a", "b"],
        "site_metrics": {
            "a": {"train_loss": 0.4, "val_loss": 0.2, "val_mean_auroc": 0.6, "val_auroc": {"X": 0.6, "Y": None}},
            "b": {"train_loss": 0.6, "val_loss": 0.4, "val_mean_auroc": 0.8, "val_auroc": {"X": 0.8, "Z": 0.7}},
        },
    }
    values, step = SurgicalAggregation().record_scalars("rounds.jsonl", record)
    assert step == 2 and values == pytest.approx(
        {
            "train_loss": 0.5,
            "val_loss": 0.3,
            "val_mean_auroc": 0.7,
            "val_auroc/X": 0.7,
            "val_auroc/Z": 0.7,
            "sites_aggregated": 2,
        }
    )
    assert SurgicalAggregation().record_scalars("rounds.jsonl", {"round": 3, "phase": "stopped"}) is None
    cycle = {"cycle": 4, "status": "completed", "val_loss": 0.25, "trained": ["a", "b", "c"]}
    assert CyclicWeightTransfer().record_scalars("cycles.jsonl", cycle) == ({"val_loss": 0.25, "sites_trained": 3}, 4)
    assert CyclicWeightTransfer().record_scalars("visits.jsonl", cycle) is None
    stage2 = {
        "stage": 2,
        "round": 5,
        "site_metrics": {"a": {"train_loss": 1.0}, "b": {"train_loss": 2.0}},
        "val_loss": 0.9,
        "site_validation": {"a": {"cc_mean_auroc": 0.5}, "b": {"cc_mean_auroc": 0.7}},
    }
    assert FedFew().record_scalars("rounds.jsonl", stage2) == (
        pytest.approx({"train_loss": 1.5, "cc_mean_auroc": 0.6, "val_loss": 0.9}),
        5,
    )
    assert FedFew().record_scalars("rounds.jsonl", {"stage": 3, "threshold": 1.0}) is None


def test_the_sites_track_the_auroc_of_each_of_their_own_classes(tmp_path):
    from cxrfl.cwt.host import CWTSiteHost
    from cxrfl.surgical.host import SurgicalSiteHost

    data = tiny_site(tmp_path, "a", {"X": [1.0, 0.0], "Y": [0.0, 1.0]}, ["train", "val"])
    answer = {
        "metrics": {
            "round": 3,
            "train_loss": 0.5,
            "val_loss": 0.4,
            "val_mean_auroc": 0.6,
            "val_auroc": {"X": 0.6, "Y": None},
        }
    }
    assert SurgicalSiteHost(data, tmp_path / "state").scalars("train", answer) == (
        {"train_loss": 0.5, "val_loss": 0.4, "val_mean_auroc": 0.6, "val_auroc/X": 0.6},
        3,
    )
    validated = {"metrics": {"split": "val", "cycle": 2, "loss": 0.3, "mean_auroc": 0.7, "auroc": {"X": 0.7}}}
    assert CWTSiteHost(data).scalars("validate", validated) == (
        {"val_loss": 0.3, "val_auroc": 0.7, "val_auroc/X": 0.7},
        2,
    )


class Writer:
    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, global_step):
        self.calls.append((tag, value, global_step))


def test_records_reach_the_writer_after_they_are_written(tmp_path):
    writer = Writer()
    loop = ServerLoop(lambda task, payloads: {}, sites=["a"], out_dir=tmp_path)
    seen = []
    loop.on_record = lambda name, record: (
        seen.append((tmp_path / "cxrfl" / name).read_text().count("\n")),
        track(writer, ({"loss": record["loss"], "none": None}, record["round"])),
    )
    loop.record({"round": 1, "loss": 0.5})
    loop.record({"round": 2, "loss": 0.25})
    assert seen == [1, 2]  # the record is on disk before it is tracked
    assert writer.calls == [("loss", 0.5, 1), ("loss", 0.25, 2)]  # missing values are not sent


def test_write_every_arg_refuses_an_attribute_that_would_hide_the_argument():
    class Component:
        def __init__(self, size: int = 1) -> None:
            self.size = str(size)

    with pytest.raises(ValueError, match="Component.size does not hold its argument"):
        write_every_arg(Component(2), {"size": 2})
    kept = write_every_arg(Component(2), {"size": "2"})
    assert kept._always_serialize_args == ("size",) and kept._size == "2"


def test_job_py_arguments_choose_nvflares_execution_environment(tmp_path, monkeypatch):
    import argparse

    from cxrfl.fl.job_script import add_run_arguments, env_from_args
    from nvflare.recipe import PocEnv, ProdEnv, SimEnv

    monkeypatch.setenv("HOME", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    sim = env_from_args(parser.parse_args(["--clients", "hospital-a,hospital-b", "--workspace", str(tmp_path)]))
    assert isinstance(sim, SimEnv) and sim.clients == ["hospital-a", "hospital-b"] and sim.num_threads == 2
    assert sim.workspace_root == str(tmp_path)
    assert env_from_args(parser.parse_args([])).num_clients == 2
    poc = env_from_args(parser.parse_args(["--env", "poc", "--clients", "a,b,c"]))
    assert isinstance(poc, PocEnv) and poc.num_clients == 3
    prod = env_from_args(parser.parse_args(["--env", "prod", "--startup_kit", str(tmp_path)]))
    assert isinstance(prod, ProdEnv) and prod.startup_kit_location == str(tmp_path)
    with pytest.raises(SystemExit, match="needs --startup_kit"):
        env_from_args(parser.parse_args(["--env", "prod"]))
    assert parser.parse_args(["--tracking", "tensorboard,mlflow"]).tracking == ("tensorboard", "mlflow")
    assert parser.parse_args(["--tracking", ""]).tracking == ()


def test_fedfew_recipe_refuses_unnamed_sites_and_names_bad_ones():
    """Issue 40 point 8: without named sites NVFlare's @ALL would send the server's app to every site."""
    with pytest.raises(ConfigError, match="name the sites"):
        FedFewRecipe(sites=[])
    with pytest.raises(ConfigError, match="job.sites must list distinct client site names"):
        FedFewRecipe(sites=["a", "server"])


GPU_REQUEST = {"num_of_gpus": 1, "num_of_cpus": 4, "memory": "32Gi"}
BIG_SITE = {"num_of_gpus": 2, "mem_per_gpu_in_GiB": 40}


def test_resource_requests_are_what_nvflare_resolves_for_each_site(tmp_path):
    """Issue 46 point 1: the GPU request sat under "@ALL" (a deploy_map keyword) where NVFlare 2.9's
    resolver never looks, so every site's resource manager was asked for nothing. The recipes of the
    three methods write the portable "@default" and per-site overrides, and NVFlare's own resolver
    gives each site its request."""
    from nvflare.utils.job_launcher_utils import get_resource_manager_spec, resolve_site_resource_spec

    sites = ["hospital-a", "hospital-b"]
    recipes = [
        SurgicalAggregationRecipe(name="s", resources=GPU_REQUEST, site_resources={"hospital-a": BIG_SITE}),
        CWTRecipe(name="c", resources=GPU_REQUEST, site_resources={"hospital-a": BIG_SITE}),
        FedFewRecipe(name="f", sites=sites, resources=GPU_REQUEST, site_resources={"hospital-a": BIG_SITE}),
    ]
    for recipe in recipes:
        meta = export(recipe, tmp_path)["meta"]
        assert meta["resource_spec"] == {"@default": GPU_REQUEST, "hospital-a": BIG_SITE}, recipe.name
        # what each site's resource manager is asked (cpus and memory are the container launchers')
        assert get_resource_manager_spec(meta, "hospital-b") == {"num_of_gpus": 1}
        assert get_resource_manager_spec(meta, "hospital-a") == BIG_SITE
        assert resolve_site_resource_spec(meta, "hospital-b") == GPU_REQUEST
    assert export(SurgicalAggregationRecipe(name="none"), tmp_path)["meta"]["resource_spec"] == {}
    only_site = export(CWTRecipe(name="one", site_resources={"hospital-a": {"num_of_gpus": 1}}), tmp_path)["meta"]
    assert get_resource_manager_spec(only_site, "hospital-a") == {"num_of_gpus": 1}
    assert get_resource_manager_spec(only_site, "hospital-b") == {}


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: SurgicalAggregationRecipe(resources={"num_of_gpus": 1, "mem_per_gpu_in_GiB": 16}),
            r"^job.resources .*unsupported field\(s\): \['mem_per_gpu_in_GiB'\]",
        ),
        (lambda: CWTRecipe(resources={"num_of_gpus": -1}), r"^job.resources .*num_of_gpus must be an integer"),
        (lambda: SurgicalAggregationRecipe(resources={"memory": "16GB"}), r"^job.resources .*memory must be"),
        (
            lambda: SurgicalAggregationRecipe(site_resources={"@ALL": {"num_of_gpus": 1}}),
            r"^job.site_resources .*\['@ALL'\].*'@default'",
        ),
        (
            lambda: CWTRecipe(site_resources={"hospital-a": {"num_of_gpus": "1"}}),
            r"^job.site_resources .*'hospital-a'.*num_of_gpus must be an integer",
        ),
        (
            lambda: FedFewRecipe(sites=["hospital-a", "hospital-b"], site_resources={"hospital-z": {"num_of_gpus": 1}}),
            r"^job.site_resources .*\['hospital-z'\].*not among the job's sites",
        ),
        (
            lambda: SurgicalAggregationRecipe(resource_spec={"@ALL": {"num_of_gpus": 1}}),
            r"^job.resource_spec is replaced by resources",
        ),
    ],
)
def test_bad_resource_requests_fail_at_construction_in_one_line_naming_the_key(make, match):
    """Issue 46 point 1: requests are checked by NVFlare's own validate_portable_resource_spec when the
    recipe is built, not when a server refuses (or, for "@ALL", silently ignores) the job."""
    with pytest.raises(ConfigError, match=match) as caught:
        make()
    assert "\n" not in str(caught.value)


def test_one_packaging_vocabulary_from_recipe_to_deployment(tmp_path, caplog):
    # issue 43 point 4: recipes said readme/none, write_job readme/none/package, `cxrfl deploy job`
    # readme/preinstalled/byoc: three vocabularies for one thing
    from cxrfl.deploy.jobs import build_job
    from cxrfl.fl.job_settings import JobSettings
    from cxrfl.fl.packaging import PACKAGING

    assert PACKAGING == ("readme", "preinstalled", "byoc")
    assert JobSettings(name="j", custom="preinstalled").custom == "preinstalled"
    assert JobSettings(name="j", custom="none").custom == "preinstalled"  # the old name, one more release
    assert any("job.custom='none' is deprecated" in r.getMessage() for r in caplog.records)
    for mode in PACKAGING:  # every value means the same app/custom in a recipe's export and a deployment folder
        apps = app_dirs(build_job("surgical_agg", tmp_path / mode, mode=mode))
        held = {
            tuple(sorted(p.name for p in (a / "custom").iterdir())) if (a / "custom").is_dir() else None for a in apps
        }
        assert held == {{"readme": ("README.md",), "preinstalled": None, "byoc": ("cxrfl",)}[mode]}, mode
    preinstalled = SurgicalAggregationRecipe(name="p", custom="preinstalled")
    preinstalled.export(str(tmp_path / "recipe"))
    assert not any((a / "custom").exists() for a in app_dirs(tmp_path / "recipe" / "p"))


def test_the_surgical_recipe_declares_the_aggregation_policy_on_the_aggregator_component_only(tmp_path):
    # issue 43 point 7: the head stitching ran inside the workflow, invisible in the job; it is now the named
    # component `aggregator` that the workflow looks up by aggregator_id, and weighting/robust/clip_norm are its
    # arguments, not the workflow's as well
    server = export(SurgicalAggregationRecipe(name="r", robust="clip", clip_norm=3.0), tmp_path)["server"]
    args = server["workflows"][0]["args"]
    (component,) = [c for c in server["components"] if c["id"] == args["aggregator_id"]]
    assert component["path"] == "cxrfl.fl.aggregator.SurgicalAggregator"
    assert component["args"] == {"weighting": "uniform", "robust": "clip", "clip_norm": 3.0}
    assert not {"weighting", "robust", "clip_norm"} & set(args)
    with pytest.raises(ConfigError, match="r aggregator"):  # checked when the job is made, as the workflow's are
        SurgicalAggregationRecipe(name="r", robust="median", weighting="samples")
    # a deployment's override of the policy reaches the component, as every other setting reaches the workflow
    from cxrfl.deploy.jobs import build_job

    job = build_job("surgical_agg", tmp_path / "deploy", overrides={"robust": "clip", "clip_norm": 2.0})
    server = json.loads((app_dirs(job)[0] / "config" / "config_fed_server.json").read_text())
    (component,) = [c for c in server["components"] if c["id"] == "aggregator"]
    assert component["args"] == {"weighting": "uniform", "robust": "clip", "clip_norm": 2.0}
    assert not {"weighting", "robust", "clip_norm"} & set(server["workflows"][0]["args"])
