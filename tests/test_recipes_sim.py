"""Each recipe runs in NVFlare's SimEnv on tiny demo data, runs exactly its exported job folder, and
leaves the artefacts of the job folder run; its metrics reach TensorBoard and MLflow.

One module-scoped run per method (32 px, one round, a few steps), and one run of the surgical
job folder with ``nvflare simulator`` to compare with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cxrfl.common.io import read_records
from cxrfl.data.labels import CHEXPERT_CLASSES, KNOWN_CLASSES, NIH_CLASSES
from cxrfl.jobs import app_dirs, job_spec, write_job
from cxrfl.nn.models import load_checkpoint
from cxrfl.synth import write_profile

pytestmark = pytest.mark.slow

TWO = ["hospital-a", "hospital-b"]
FEDFEW_SITES = ["cc-1", "cc-2", "uc-hernia"]


def tiny(name: str, **changes: dict) -> object:
    """A job of JOBS with its settings (nested dicts updated) made tiny."""
    spec = job_spec(name)
    args = json.loads(json.dumps(spec.controller_args))
    for key, value in changes.items():
        if isinstance(value, dict):
            args[key].update(value)
        else:
            args[key] = value
    return dataclasses.replace(spec, name=f"tiny_{name}", controller_args=args)


SPECS = {
    "surgical": dataclasses.replace(
        tiny(
            "surgical_agg",
            num_rounds=1,
            model_config={"image_size": 32},
            train_config={"warmup_epochs": 1, "batch_size": 8, "max_steps_per_epoch": 2},
        ),
        tracking=("tensorboard", "mlflow"),
    ),
    "cwt": tiny(
        "cwt",
        model_config={"image_size": 32},
        cwt_config={"num_cycles": 1, "local_steps": 1, "batch_size": 8, "plti": False},
    ),
    "fedfew": dataclasses.replace(
        tiny(
            "fedfew",
            model_config={"image_size": 32},
            fedfew_config={
                "ssl_rounds": 1,
                "ssl_max_steps": 1,
                "ssl_batch_size": 8,
                "ssl_proj_dim": 64,
                "ssl_pred_dim": 16,
                "warmup_rounds": 1,
                "rounds": 1,
                "batch_size": 16,
                "max_steps_per_epoch": 1,
                "min_prototype_images": 2,
                "threshold_bins": 64,
                "eval_batch_size": 64,
            },
        ),
        sites=tuple(FEDFEW_SITES),
    ),
}
SITES = {"surgical": TWO, "cwt": TWO, "fedfew": FEDFEW_SITES}


def app_of(ws: Path) -> Path:
    return ws / "server" / "simulate_job" / "app_server"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from nvflare.recipe import SimEnv

    tmp = tmp_path_factory.mktemp("recipes")
    data = tmp / "data"
    for config in write_profile("two-hospitals", data, n_per_site=30, image_size=32, sites=TWO):
        # a larger validation split, so that per-class validation AUROCs are defined
        config.write_text(config.read_text().replace("train: 0.7\n  val: 0.1", "train: 0.5\n  val: 0.3"))
        assert "val: 0.3" in config.read_text()
    write_profile("fedfew", data, n_per_site=40, image_size=32, sites=FEDFEW_SITES[:2])
    write_profile("fedfew", data, n_per_site=120, image_size=32, sites=FEDFEW_SITES[2:])
    out = {"tmp": tmp, "data": data}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CXRFL_SITE_CONFIG_DIR", str(data))
        mp.setenv("HOME", str(tmp / "home"))
        for method, spec in SPECS.items():
            root = tmp / "sim"
            spec.recipe().execute(
                SimEnv(clients=SITES[method], num_threads=len(SITES[method]), workspace_root=str(root))
            )
            out[method] = {
                "ws": root / spec.name,
                "app": app_of(root / spec.name),
                "job": write_job(spec, tmp / "exported"),
            }
        # the surgical job folder, run as the README runs jobs/surgical_agg
        cli = tmp / "cli"
        proc = subprocess.run(
            [
                str(Path(sys.executable).with_name("nvflare")),
                "simulator",
                str(out["surgical"]["job"]),
                "-w",
                str(cli),
                "-c",
                ",".join(TWO),
                "-t",
                "2",
            ],
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=900,
        )
    out["folder"] = {"ws": cli, "app": app_of(cli), "proc": proc}
    for key in ("surgical", "cwt", "fedfew", "folder"):
        if not (out[key]["app"] / "FL_global_model.pt").is_file():
            pytest.fail(f"{key}: no global model under {out[key]['app']}")
    return out


def _configs(folder: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


@pytest.mark.parametrize("method", list(SPECS))
def test_simenv_ran_the_exported_job_folder(runs, method):
    deployed = _configs(runs[method]["app"] / "config")
    exported = _configs(app_dirs(runs[method]["job"])[0] / "config")  # "app", or FedFew's "app_server"
    assert deployed == exported and "config_fed_server.json" in deployed
    assert (runs[method]["app"] / "custom" / "README.md").is_file()  # the job's README-only app/custom
    if method == "fedfew":  # issue 40 point 8: the server's config reached the server only
        for site in SITES[method]:
            assert (runs[method]["ws"] / site).is_dir() and not list(
                (runs[method]["ws"] / site).rglob("config_fed_server.json")
            ), site


def _files(app: Path) -> set[str]:
    return {str(p.relative_to(app)) for p in app.rglob("*") if p.is_file()}


def test_the_surgical_recipe_leaves_what_its_job_folder_run_leaves(runs):
    recipe, folder = runs["surgical"]["app"], runs["folder"]["app"]
    assert _files(recipe) == _files(folder)
    assert {
        "FL_global_model.pt",
        "best_FL_global_model.pt",
        "cxrfl/rounds.jsonl",
        "cxrfl/evaluation.json",
        "cxrfl/run_config.json",
        "cxrfl/checkpoints/round_001.pt",
    } <= _files(recipe)
    a, b = load_checkpoint(recipe / "FL_global_model.pt"), load_checkpoint(folder / "FL_global_model.pt")
    assert a["classes"] == b["classes"] == list(KNOWN_CLASSES) and a["round"] == b["round"] == 1
    for k, v in a["model"].items():  # same seeds, same data, same job: the same weights
        torch.testing.assert_close(b["model"][k], v, rtol=0, atol=0, msg=k)
    strip = ("seconds", "site_metrics")
    rounds = [
        [{k: v for k, v in r.items() if k not in strip} for r in read_records(app / "cxrfl" / "rounds.jsonl")]
        for app in (recipe, folder)
    ]
    assert rounds[0] == rounds[1] and [r["round"] for r in rounds[0]] == [0, 1, 1]
    tb = runs["surgical"]["ws"] / "server" / "simulate_job" / "tb_events"
    assert {p.name for p in tb.iterdir()} == {*TWO, "simulator_server"}  # each site's curves, and the server's


def test_cwt_and_fedfew_recipes_leave_their_artefacts(runs):
    cwt = runs["cwt"]["app"]
    assert {"FL_global_model.pt", "best_FL_global_model.pt", "cxrfl/cycles.jsonl", "cxrfl/evaluation.json"} <= _files(
        cwt
    )
    cycles = [r for r in read_records(cwt / "cxrfl" / "cycles.jsonl") if r["status"] == "completed"]
    assert [r["cycle"] for r in cycles] == [1] and sorted(cycles[0]["trained"]) == TWO
    fedfew = runs["fedfew"]["app"]
    assert {"fedfew/stage1_ssl.pt", "fedfew/stage2_model.pt", "fedfew/stage3.json", "FL_global_model.pt"} <= _files(
        fedfew
    )
    assert load_checkpoint(fedfew / "FL_global_model.pt")["method"] == "fedfew"


def _mlflow(runs):
    """The MLflow client of the run's local store, and its runs by sender (NVFlare names them ``<sender>-...``)."""
    from mlflow.tracking import MlflowClient

    store = runs["surgical"]["ws"] / "server" / "simulate_job" / "mlflow.db"
    assert store.is_file()  # the local store: no MLflow server
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "tiny_surgical_agg"]
    found = client.search_runs([experiment.experiment_id])
    senders = [*TWO, "simulator_server"]
    assert len(found) == len(senders)
    return client, {s: next(r for r in found if r.info.run_name.startswith(f"{s}-")) for s in senders}


def test_mlflow_store_holds_every_sites_curves_and_the_servers(runs):
    client, by_site = _mlflow(runs)
    records = {
        r["round"]: r
        for r in read_records(runs["surgical"]["app"] / "cxrfl" / "rounds.jsonl")
        if r["phase"] in ("warmup", "train")
    }
    for site, own in (("hospital-a", NIH_CLASSES), ("hospital-b", CHEXPERT_CLASSES)):
        run = by_site[site]
        for name in ("train_loss", "val_loss"):
            history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
            assert history == pytest.approx({rnd: records[rnd]["site_metrics"][site][name] for rnd in (0, 1)})
        per_class = {k.split("/", 1)[1] for k in run.data.metrics if k.startswith("val_auroc/")}
        assert per_class and per_class <= set(own)  # its own classes only: nothing names another site's
        for c in per_class:
            history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"val_auroc/{c}")}
            assert history == pytest.approx(
                {rnd: records[rnd]["site_metrics"][site]["val_auroc"][c] for rnd in history}
            )
    server = by_site["simulator_server"]
    history = {m.step: m.value for m in client.get_metric_history(server.info.run_id, "val_loss")}
    assert history == pytest.approx(
        {rnd: sum(records[rnd]["site_metrics"][s]["val_loss"] for s in TWO) / 2 for rnd in (0, 1)}
    )
    assert {m.step: m.value for m in client.get_metric_history(server.info.run_id, "sites_aggregated")} == {0: 2, 1: 2}


def test_a_bundle_of_the_run_carries_its_settings_and_evaluation(runs, tmp_path):
    from cxrfl.bundle import export_bundle

    app = runs["surgical"]["app"]
    bundle = export_bundle(app / "best_FL_global_model.pt", tmp_path / "bundle")
    card = (bundle / "docs" / "README.md").read_text()
    evaluation = json.loads((app / "cxrfl" / "evaluation.json").read_text())
    assert '"num_rounds": 1' in card and f"round {evaluation['best_round']}" in card
    for c in KNOWN_CLASSES:
        values = [s["auroc"][c] for s in evaluation["sites"].values() if s["auroc"].get(c) is not None]
        if values:
            assert f"| {c} | {sum(values) / len(values):.3f} |" in card
    assert "hospital-a" not in card and "hospital-b" not in card  # the card names no site
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert meta["network_data_format"]["outputs"]["pred"]["channel_def"] == {
        str(i): c for i, c in enumerate(KNOWN_CLASSES)
    }
