"""Each recipe runs in NVFlare's SimEnv on tiny demo data, runs exactly its exported job folder, and
leaves the artefacts of the job folder run; its metrics reach TensorBoard and MLflow.

One run per method (32 px, the tiny network, a few steps; surgical: the session's ``surgical_simenv``), and
the session's run of the surgical job folder with ``nvflare simulator`` (``surgical_sim``) to compare with.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import DEMO, SURGICAL, TINY_MODEL, TWO, app_of, tiny
from cxrfl.common.io import read_records
from cxrfl.data.labels import CHEXPERT_CLASSES, KNOWN_CLASSES, NIH_CLASSES
from cxrfl.jobs import app_dirs, write_job
from cxrfl.nn.models import load_checkpoint
from cxrfl.synth import write_profile

pytestmark = pytest.mark.slow

FEDFEW_SITES = ["cc-1", "cc-2", "uc-hernia"]

SPECS = {
    "surgical": SURGICAL,
    "cwt": tiny(
        "cwt",
        model_config=TINY_MODEL,
        cwt_config={"num_cycles": 1, "local_steps": 1, "batch_size": 8, "plti": False},
    ),
    "fedfew": dataclasses.replace(
        tiny(
            "fedfew",
            model_config=TINY_MODEL,
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
SITES = {"surgical": DEMO, "cwt": TWO, "fedfew": FEDFEW_SITES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, two_hospitals, surgical_simenv, surgical_sim):
    """Each method's recipe in SimEnv (surgical: the session's run) with its exported job folder (``job``), and
    the surgical job folder under ``nvflare simulator`` (``folder``: the session's run)."""
    from nvflare.recipe import SimEnv

    tmp = tmp_path_factory.mktemp("recipes")
    fedfew = tmp / "data"
    write_profile("fedfew", fedfew, n_per_site=40, image_size=32, sites=FEDFEW_SITES[:2])
    write_profile("fedfew", fedfew, n_per_site=120, image_size=32, sites=FEDFEW_SITES[2:])
    out = {"surgical": {**surgical_simenv, "job": surgical_sim["job"]}, "folder": surgical_sim}
    for method, data in (("cwt", two_hospitals), ("fedfew", fedfew)):
        spec, root = SPECS[method], tmp / "sim"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CXRFL_SITE_CONFIG_DIR", str(data))
            mp.setenv("HOME", str(tmp / "home"))
            spec.recipe().execute(
                SimEnv(clients=SITES[method], num_threads=len(SITES[method]), workspace_root=str(root))
            )
        out[method] = {
            "ws": root / spec.name,
            "app": app_of(root / spec.name),
            "job": write_job(spec, tmp / "exported"),
        }
        if not (out[method]["app"] / "FL_global_model.pt").is_file():
            pytest.fail(f"{method}: no global model under {out[method]['app']}")
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
    rounds = runs["surgical"]["args"]["num_rounds"]
    recipe, folder = runs["surgical"]["app"], runs["folder"]["app"]
    assert _files(recipe) == _files(folder)
    assert {
        "FL_global_model.pt",
        "best_FL_global_model.pt",
        "cxrfl/rounds.jsonl",
        "cxrfl/evaluation.json",
        "cxrfl/run_config.json",
        *(f"cxrfl/checkpoints/round_{r:03d}.pt" for r in range(1, rounds + 1)),
    } <= _files(recipe)
    a, b = load_checkpoint(recipe / "FL_global_model.pt"), load_checkpoint(folder / "FL_global_model.pt")
    assert a["classes"] == b["classes"] == list(KNOWN_CLASSES) and a["round"] == b["round"] == rounds
    for k, v in a["model"].items():  # same seeds, same data, same job: the same weights
        torch.testing.assert_close(b["model"][k], v, rtol=0, atol=0, msg=k)
    strip = ("seconds", "site_metrics")
    records = [
        [{k: v for k, v in r.items() if k not in strip} for r in read_records(app / "cxrfl" / "rounds.jsonl")]
        for app in (recipe, folder)
    ]
    assert records[0] == records[1] and [r["round"] for r in records[0]] == [*range(rounds + 1), rounds]
    tb = runs["surgical"]["ws"] / "server" / "simulate_job" / "tb_events"
    assert {p.name for p in tb.iterdir()} == {*DEMO, "simulator_server"}  # each site's curves, and the server's


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
    (experiment,) = [e for e in client.search_experiments() if e.name == SURGICAL.name]
    found = client.search_runs([experiment.experiment_id])
    senders = [*DEMO, "simulator_server"]
    assert len(found) == len(senders)
    return client, {s: next(r for r in found if r.info.run_name.startswith(f"{s}-")) for s in senders}


def test_mlflow_store_holds_every_sites_curves_and_the_servers(runs):
    client, by_site = _mlflow(runs)
    steps = range(runs["surgical"]["args"]["num_rounds"] + 1)  # the warm-up (0) and every round
    records = {
        r["round"]: r
        for r in read_records(runs["surgical"]["app"] / "cxrfl" / "rounds.jsonl")
        if r["phase"] in ("warmup", "train")
    }
    for site, own in (("site-1", NIH_CLASSES), ("site-2", CHEXPERT_CLASSES)):
        run = by_site[site]
        for name in ("train_loss", "val_loss"):
            history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
            assert history == pytest.approx({rnd: records[rnd]["site_metrics"][site][name] for rnd in steps})
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
        {rnd: sum(records[rnd]["site_metrics"][s]["val_loss"] for s in DEMO) / 2 for rnd in steps}
    )
    aggregated = {m.step: m.value for m in client.get_metric_history(server.info.run_id, "sites_aggregated")}
    assert aggregated == dict.fromkeys(steps, 2)


def test_a_bundle_of_the_run_carries_its_settings_and_evaluation(runs, tmp_path):
    from cxrfl.bundle import export_bundle

    app = runs["surgical"]["app"]
    bundle = export_bundle(app / "best_FL_global_model.pt", tmp_path / "bundle")
    card = (bundle / "docs" / "README.md").read_text()
    evaluation = json.loads((app / "cxrfl" / "evaluation.json").read_text())
    assert (
        f'"num_rounds": {runs["surgical"]["args"]["num_rounds"]}' in card
        and f"round {evaluation['best_round']}" in card
    )
    for c in KNOWN_CLASSES:
        values = [s["auroc"][c] for s in evaluation["sites"].values() if s["auroc"].get(c) is not None]
        if values:
            assert f"| {c} | {sum(values) / len(values):.3f} |" in card
    assert not [s for s in (*DEMO, *TWO) if s in card]  # the card names no site
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert meta["network_data_format"]["outputs"]["pred"]["channel_def"] == {
        str(i): c for i, c in enumerate(KNOWN_CLASSES)
    }
