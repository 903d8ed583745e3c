"""End to end: `nvflare simulator jobs/surgical_agg` on small demo data, two hospitals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cxrfl.data.labels import CHEXPERT_CLASSES, KNOWN_CLASSES, NIH_CLASSES, NIH_COLUMN_NAMES
from cxrfl.synth import write_profile
from conftest import names_in

pytestmark = pytest.mark.slow

NIH_ONLY = sorted(set(NIH_CLASSES) - set(CHEXPERT_CLASSES))
CHEXPERT_ONLY = sorted(set(CHEXPERT_CLASSES) - set(NIH_CLASSES))


def nvflare_bin() -> str:
    return str(Path(sys.executable).with_name("nvflare"))


def small_job(repo_root: Path, out: Path, *, rounds: int = 2) -> Path:
    """The real jobs/surgical_agg with fewer rounds and steps."""
    job = out / "surgical_agg"
    shutil.copytree(repo_root / "jobs" / "surgical_agg", job)
    cfg_path = job / "app" / "config" / "config_fed_server.json"
    cfg = json.loads(cfg_path.read_text())
    args = cfg["workflows"][0]["args"]
    args["num_rounds"] = rounds
    args["train_config"].update(warmup_epochs=1, batch_size=16, max_steps_per_epoch=3)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return job


@pytest.fixture(scope="module")
def simulated(tmp_path_factory, repo_root):
    tmp = tmp_path_factory.mktemp("sim")
    configs = write_profile("two-hospitals", tmp / "data", n_per_site=60, image_size=64, sites=["hospital-a", "hospital-b"])
    assert {p.stem for p in configs} == {"hospital-a", "hospital-b"}
    job = small_job(repo_root, tmp)
    ws = tmp / "ws"
    env = {**os.environ, "CXRFL_SITE_CONFIG_DIR": str(tmp / "data"), "HOME": str(tmp / "home")}
    proc = subprocess.run(
        [nvflare_bin(), "simulator", str(job), "-w", str(ws), "-c", "hospital-a,hospital-b", "-t", "2"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    app = ws / "server" / "simulate_job" / "app_server"
    if not (app / "FL_global_model.pt").is_file():
        pytest.fail(f"simulator left no global model (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return {"ws": ws, "app": app, "proc": proc}


def test_global_model_names_the_union(simulated):
    ckpt = torch.load(simulated["app"] / "FL_global_model.pt", map_location="cpu", weights_only=False)
    assert ckpt["classes"] == list(KNOWN_CLASSES)
    assert len(ckpt["classes"]) == 20
    assert ckpt["model"]["classifier.weight"].shape[0] == 20
    assert ckpt["round"] == 2
    best = torch.load(simulated["app"] / "best_FL_global_model.pt", map_location="cpu", weights_only=False)
    assert best["classes"] == list(KNOWN_CLASSES)


def test_aggregation_record_lists_exact_contributors(simulated):
    lines = (simulated["app"] / "cxrfl" / "rounds.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["round"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["aggregated"], r
        assert r["sites_aggregated"] == ["hospital-a", "hospital-b"]
        contributors = r["contributors"]
        assert set(contributors) == set(KNOWN_CLASSES)
        for c in KNOWN_CLASSES:
            expected = sorted(s for s, cls in (("hospital-a", NIH_CLASSES), ("hospital-b", CHEXPERT_CLASSES)) if c in cls)
            assert contributors[c] == expected, c
        for site, m in r["site_metrics"].items():
            assert m["val_loss"] > 0


def test_evaluation_written_for_both_sites(simulated):
    ev = json.loads((simulated["app"] / "cxrfl" / "evaluation.json").read_text())
    assert set(ev["sites"]) == {"hospital-a", "hospital-b"}
    assert len(ev["shared_classes"]) == 7
    assert set(ev["sites"]["hospital-a"]["auroc"]) == set(NIH_CLASSES)
    assert set(ev["sites"]["hospital-b"]["auroc"]) == set(CHEXPERT_CLASSES)



@pytest.mark.parametrize("site,foreign", [("hospital-b", NIH_ONLY), ("hospital-a", CHEXPERT_ONLY)])
def test_no_site_file_names_the_other_sites_classes(simulated, site, foreign):
    root = simulated["ws"] / site
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "log.txt" for p in files)
    foreign_names = foreign + [k for k, v in NIH_COLUMN_NAMES.items() if v in foreign]
    leaks = {str(p.relative_to(root)): names_in(p, foreign_names) for p in files}
    assert {p: n for p, n in leaks.items() if n} == {}
