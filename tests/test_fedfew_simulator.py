"""End to end: `nvflare simulator jobs/fedfew` through all three stages on tiny data, then
`cxrfl predict` on the final model, then a run resumed (``resume_from``) from stage files that
reuses stages 1 and 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cxrfl.cli import main
from cxrfl.fedfew.learner import NO_CC
from cxrfl.synth import write_profile
from cxrfl.synth.fedfew_profile import FEDFEW_CCS

pytestmark = pytest.mark.slow

SITES = ["cc-1", "cc-2", "uc-hernia"]


def nvflare_bin() -> str:
    return str(Path(sys.executable).with_name("nvflare"))


def small_job(repo_root: Path, out: Path, name: str, resume_from: str | None = None) -> Path:
    """The real jobs/fedfew with one short round per stage at 32x32."""
    job = out / name
    shutil.copytree(repo_root / "jobs" / "fedfew", job)
    cfg_path = job / "app" / "config" / "config_fed_server.json"
    cfg = json.loads(cfg_path.read_text())
    args = cfg["workflows"][0]["args"]
    args["model_config"]["image_size"] = 32
    args["fedfew_config"].update(ssl_rounds=1, ssl_max_steps=1, ssl_batch_size=8, ssl_proj_dim=64, ssl_pred_dim=16,
                                 warmup_rounds=1, rounds=1, batch_size=16, max_steps_per_epoch=1, min_prototype_images=2,
                                 threshold_bins=64, eval_batch_size=64)
    args["resume_from"] = resume_from
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return job


def simulate(job: Path, ws: Path, data: Path, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CXRFL_SITE_CONFIG_DIR": str(data), "HOME": str(home)}
    return subprocess.run([nvflare_bin(), "simulator", str(job), "-w", str(ws), "-c", ",".join(SITES), "-t", str(len(SITES))],
                          env=env, capture_output=True, text=True, timeout=900)


def records(app: Path) -> list[dict]:
    return [json.loads(line) for line in (app / "cxrfl" / "rounds.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory, repo_root):
    tmp = tmp_path_factory.mktemp("fedfew-sim")
    data = tmp / "data"
    write_profile("fedfew", data, n_per_site=60, image_size=32, sites=SITES[:2])
    write_profile("fedfew", data, n_per_site=160, image_size=32, sites=SITES[2:])  # ~10 Hernia positives in train
    proc = simulate(small_job(repo_root, tmp, "fedfew"), tmp / "ws", data, tmp / "home")
    app = tmp / "ws" / "server" / "simulate_job" / "app_server"
    if not (app / "FL_global_model.pt").is_file():
        pytest.fail(f"simulator left no final model (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return {"tmp": tmp, "data": data, "ws": tmp / "ws", "app": app, "proc": proc}


def test_all_three_stages_ran_and_left_their_results(simulated):
    app = simulated["app"]
    for name in ("stage1_ssl.pt", "stage2_model.pt", "stage3.json"):
        assert (app / "fedfew" / name).is_file(), name
    recs = records(app)
    assert [r["stage"] for r in recs] == [1, 2, 2, 3]
    assert recs[0]["sites_aggregated"] == SITES  # every site's images, labelled or not, in stage 1
    assert recs[1]["phase"] == "warm-up" and recs[1]["sites_aggregated"] == ["cc-1", "cc-2"]  # no UC loss without lambda
    assert recs[2]["phase"] == "energy" and recs[2]["sites_aggregated"] == SITES
    assert recs[2]["margins"]["chosen"] == "warm-up" and recs[2]["margins"]["m_in"] < recs[2]["margins"]["m_out"]
    plan = json.loads((app / "cxrfl" / "plan.json").read_text())
    assert plan["uc_classes"] == ["Hernia"] and plan["uc_sites"] == {"Hernia": ["uc-hernia"]}
    assert plan["cc_classes"] == sorted(FEDFEW_CCS)


def test_final_checkpoint_is_self_describing(simulated):
    ckpt = torch.load(simulated["app"] / "FL_global_model.pt", map_location="cpu", weights_only=True)
    assert ckpt["format"] == "cxrfl-checkpoint-v1" and ckpt["method"] == "fedfew"
    assert ckpt["classes"] == [*sorted(FEDFEW_CCS), NO_CC]
    assert any(k.startswith("backbone.") for k in ckpt["model"])  # encoder
    assert ckpt["model"]["classifier.weight"].shape[0] == len(FEDFEW_CCS) + 1  # CC head + "no CC"
    ff = ckpt["fedfew"]
    assert ff["cc_classes"] == sorted(FEDFEW_CCS) and ff["uc_classes"] == ["Hernia"]
    assert isinstance(ff["threshold"], float)
    (pair,) = ff["prototypes"]["Hernia"]
    assert pair["positive"].shape == pair["negative"].shape == (1024,)
    assert pair["n_positive"] >= 2 and pair["n_negative"] >= 2 and "site" not in pair  # anonymous source
    assert ckpt["model_config"]["image_size"] == 32


def test_sites_logged_each_stage_and_evaluation_written(simulated):
    log = (simulated["ws"] / "uc-hernia" / "log.txt").read_text()
    assert "stage 1 round 1" in log and "stage 2 round 2" in log and "sent the prototypes of ['Hernia']" in log
    ev = json.loads((simulated["app"] / "cxrfl" / "evaluation.json").read_text())
    assert set(ev["sites"]) == set(SITES)


def test_predict_prints_the_uc_outputs(simulated, capsys):
    image = next((simulated["data"] / "uc-hernia" / "images").glob("*.png"))
    assert main(["predict", "--model", str(simulated["app"] / "FL_global_model.pt"), str(image)]) == 0
    out = capsys.readouterr().out
    assert "Hernia" in out and "energy" in out and "rare class" in out
    assert NO_CC not in out
    assert main(["predict", "--model", str(simulated["app"] / "FL_global_model.pt"), str(image), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert set(row["underrepresented"]) == {"Hernia"} and set(row["probabilities"]) == set(FEDFEW_CCS)


def test_resume_reuses_finished_stages(simulated, repo_root):
    tmp = simulated["tmp"]
    earlier = tmp / "stages-1-2"
    earlier.mkdir()
    for name in ("stage1_ssl.pt", "stage2_model.pt"):
        shutil.copy2(simulated["app"] / "fedfew" / name, earlier / name)
    proc = simulate(small_job(repo_root, tmp, "fedfew-resume", resume_from=str(earlier)), tmp / "ws2", simulated["data"], tmp / "home")
    app = tmp / "ws2" / "server" / "simulate_job" / "app_server"
    assert (app / "FL_global_model.pt").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["stage"] for r in records(app)] == [3]  # stages 1 and 2 were loaded, not run
    assert (app / "fedfew" / "stage2_model.pt").read_bytes() == (earlier / "stage2_model.pt").read_bytes()
    first = torch.load(simulated["app"] / "FL_global_model.pt", map_location="cpu", weights_only=True)
    again = torch.load(app / "FL_global_model.pt", map_location="cpu", weights_only=True)
    assert torch.equal(first["model"]["classifier.weight"], again["model"]["classifier.weight"])
    assert again["fedfew"]["threshold"] == pytest.approx(first["fedfew"]["threshold"])
    assert "resume: stage(s) 1-2 loaded" in (tmp / "ws2" / "server" / "log.txt").read_text()
