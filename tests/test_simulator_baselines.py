"""The federated baseline jobs under `nvflare simulator`: the same controller, other head modes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, names_in, nvflare_bin
from cxrfl.data.labels import CHEXPERT_CLASSES, KNOWN_CLASSES, NIH_CLASSES, NIH_COLUMN_NAMES
from cxrfl.synth import write_profile

pytestmark = pytest.mark.slow

NIH_ONLY = sorted(set(NIH_CLASSES) - set(CHEXPERT_CLASSES))


def run_job(repo_root: Path, tmp: Path, name: str, model_config: dict) -> Path:
    """jobs/``name`` with 2 small rounds, its ``model_config`` updated, under ``nvflare simulator``."""
    job = tmp / name
    shutil.copytree(repo_root / "jobs" / name, job)
    cfg_path = job / "app" / "config" / "config_fed_server.json"
    cfg = json.loads(cfg_path.read_text())
    args = cfg["workflows"][0]["args"]
    args["num_rounds"] = 2
    args["model_config"].update(model_config)
    args["train_config"].update(warmup_epochs=1, batch_size=8, max_steps_per_epoch=2)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    client = job / "app" / "config" / "config_fed_client.json"
    ccfg = json.loads(client.read_text())
    ccfg["executors"][0]["executor"]["args"]["num_threads"] = 1
    client.write_text(json.dumps(ccfg, indent=2))
    ws = tmp / f"ws-{name}"
    env = {**os.environ, "CXRFL_SITE_CONFIG_DIR": str(tmp / "data"), "HOME": str(tmp / "home")}
    proc = subprocess.run(
        [
            nvflare_bin(),
            "simulator",
            str(job),
            "-w",
            str(ws),
            "-c",
            "hospital-a,hospital-b",
            "-t",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    app = ws / "server" / "simulate_job" / "app_server"
    if not (app / "cxrfl" / "evaluation.json").is_file():
        pytest.fail(
            f"{name}: no evaluation written (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return ws


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("baselines")
    write_profile("two-hospitals", tmp / "data", n_per_site=40, image_size=32, sites=["hospital-a", "hospital-b"])
    return tmp


def test_vanilla_fl_job_trains_one_union_head(data, repo_root):
    # DenseNet121 on purpose: the one NVFlare run of the suite whose messages are the product's (every site
    # sends the whole 28 MB float32 model, unquantized); every other run uses the tiny network
    ws = run_job(repo_root, data, "vanilla_fl", {"arch": "densenet121", "image_size": 32})
    app = ws / "server" / "simulate_job" / "app_server"
    ckpt = torch.load(app / "FL_global_model.pt", map_location="cpu", weights_only=False)
    assert ckpt["classes"] == list(KNOWN_CLASSES) and ckpt["head_mode"] == "union"
    records = [json.loads(line) for line in (app / "cxrfl" / "rounds.jsonl").read_text().splitlines()]
    assert [(r["round"], r["phase"]) for r in records] == [(0, "warmup"), (1, "train"), (2, "train"), (2, "validate")]
    assert all(r["aggregated"] for r in records[:3])
    for r in records[1:3]:  # after the warm-up every site sends every row
        assert all(r["contributors"][c] == ["hospital-a", "hospital-b"] for c in KNOWN_CLASSES)
    ev = json.loads((app / "cxrfl" / "evaluation.json").read_text())
    assert set(ev["sites"]["hospital-a"]["auroc"]) >= set(NIH_CLASSES)


def test_personalized_fl_job_keeps_heads_at_the_sites(data, repo_root):
    ws = run_job(repo_root, data, "personalized_fl", TINY_MODEL)
    app = ws / "server" / "simulate_job" / "app_server"
    ckpt = torch.load(app / "FL_global_model.pt", map_location="cpu", weights_only=False)
    assert ckpt["classes"] == [] and ckpt["head_mode"] == "local"
    assert not any(k.startswith("classifier.") for k in ckpt["model"])  # the server never held a head
    ev = json.loads((app / "cxrfl" / "evaluation.json").read_text())
    assert set(ev["sites"]) == {"hospital-a", "hospital-b"}
    assert set(ev["sites"]["hospital-b"]["auroc"]) == set(CHEXPERT_CLASSES)
    heads = list((ws / "hospital-a").rglob("local_head.pt"))
    assert heads, "hospital-a keeps its head on its own disk"
    kept = sorted(p.name for p in (ws / "hospital-a").rglob("local_rounds/round_*.pt"))
    assert f"round_{ev['best_round']:03d}.pt" in kept  # with the head of the selected round, which was tested
    root = ws / "hospital-b"  # and no file of hospital-b names a class only hospital-a has
    foreign = NIH_ONLY + [k for k, v in NIH_COLUMN_NAMES.items() if v in NIH_ONLY]
    leaks = {str(p.relative_to(root)): names_in(p, foreign) for p in root.rglob("*") if p.is_file()}
    assert {p: n for p, n in leaks.items() if n} == {}
