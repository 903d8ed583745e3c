"""End to end in `nvflare simulator jobs/fedfew` on tiny data, with faults injected:

1. ``killed``: two sites fail their stage-1 task in round 1 (``min_clients`` 2, so the round has
   too few valid results and is run again); the whole simulator (server included) is killed once
   stage 2's round 1 is recorded;
2. ``resumed``: the same job submitted with ``resume_from`` set to the killed run's job id (its
   resume folder copied to a store outside the simulator's workspace, ``CXRFL_RESUME_ROOT``):
   stage 1 is not run again, stage 2 goes on with round 2 from the saved weights (compared as
   tensors with what a site received), stage 3 follows; then ``cxrfl predict`` on the final model.

A round that never gets enough valid results stops the run with its reason: the same server loop
in ``tests/test_fedfew_server.py`` (the NVFlare glue that turns the stop into a ``panic`` is
:class:`cxrfl.fl.base.TaskController`'s, shown for surgical aggregation by ``tests/test_reliability.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, app_of, nvflare_bin
from cxrfl.cli import main
from cxrfl.common.io import read_records
from cxrfl.common.resume import RESUME_ROOT_ENV
from cxrfl.fedfew.learner import NO_CC
from cxrfl.jobs import job_spec, write_job
from cxrfl.nn.models import CXRNet, ModelConfig
from cxrfl.synth import write_profile
from cxrfl.synth.fedfew_profile import FEDFEW_CCS

pytestmark = pytest.mark.slow

SITES = ["cc-1", "cc-2", "uc-hernia"]
FAULTY = Path(__file__).parent / "faults" / "fedfew_executor.py"


def small_job(out: Path, name: str, resume_from: str | None = None) -> Path:
    """jobs/fedfew (exported for our sites) with short stages (the tiny network at 32x32), every site on the
    fault-injecting executor."""
    job = write_job(
        dataclasses.replace(job_spec("fedfew"), name=name, sites=tuple(SITES)), out
    )  # jobs/fedfew, our sites
    cfg_path = job / "app_server" / "config" / "config_fed_server.json"
    cfg = json.loads(cfg_path.read_text())
    args = cfg["workflows"][0]["args"]
    args["model_config"].update(TINY_MODEL)
    args["fedfew_config"].update(
        ssl_rounds=1,
        ssl_max_steps=1,
        ssl_batch_size=8,
        ssl_proj_dim=64,
        ssl_pred_dim=16,
        warmup_rounds=1,
        rounds=2,
        patience=5,
        batch_size=16,
        max_steps_per_epoch=1,
        min_prototype_images=2,
        threshold_bins=64,
        eval_batch_size=64,
    )
    args.update(resume_from=resume_from, min_clients=2, min_clients_timeout=300, retry_pause=1)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    for site in SITES:
        (job / f"app_{site}" / "custom").mkdir()
        shutil.copy(FAULTY, job / f"app_{site}" / "custom" / FAULTY.name)
        client_path = job / f"app_{site}" / "config" / "config_fed_client.json"
        client = json.loads(client_path.read_text())
        executor = client["executors"][0]["executor"]
        executor["path"] = "fedfew_executor.FaultyFedFewExecutor"
        executor["args"].update(faults={"cc-2": ["fedfew_ssl:1"], "uc-hernia": ["fedfew_ssl:1"]}, keep_received=SITES)
        client_path.write_text(json.dumps(client, indent=2))
    return job


def records(app: Path) -> list[dict]:
    return read_records(app / "cxrfl" / "rounds.jsonl")


def simulate(
    job: Path, ws: Path, data: Path, home: Path, kill_when=None, timeout: float = 900, resume_root: Path | None = None
) -> str:
    """Run the simulator (its output returned); ``kill_when(records)`` True kills its whole process group;
    ``resume_root``: the server's folder of resume states (the simulator replaces its workspace every run)."""
    env = {**os.environ, "CXRFL_SITE_CONFIG_DIR": str(data), "HOME": str(home)}
    if resume_root is not None:
        env[RESUME_ROOT_ENV] = str(resume_root)
    cmd = [nvflare_bin(), "simulator", str(job), "-w", str(ws), "-c", ",".join(SITES), "-t", str(len(SITES))]
    log_path = ws.parent / f"{ws.name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if kill_when is not None and kill_when(records(app_of(ws))):
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.5)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return log_path.read_text()


def stage2_round_done(rnd: int):
    return lambda recs: any(r.get("stage") == 2 and r.get("round") == rnd and "status" not in r for r in recs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, repo_root):
    tmp = tmp_path_factory.mktemp("fedfew-sim")
    data = tmp / "data"
    write_profile("fedfew", data, n_per_site=60, image_size=32, sites=SITES[:2])
    write_profile("fedfew", data, n_per_site=160, image_size=32, sites=SITES[2:])  # ~10 Hernia positives in train
    out1 = simulate(small_job(tmp, "killed"), tmp / "ws1", data, tmp / "home", kill_when=stage2_round_done(1))
    killed = app_of(tmp / "ws1")
    resume = tmp / "ws1" / "server" / "cxrfl_resume" / "simulate_job"
    if not (resume / "state.pt").is_file():
        pytest.fail(f"the killed run left no stage-2 state in {resume}:\n{out1[-4000:]}")
    saved = torch.load(resume / "state.pt", map_location="cpu", weights_only=True)
    kept = tmp / "kept"  # the simulator's next run replaces the workspace: keep the interrupted run's folder
    shutil.copytree(resume, kept)
    shutil.copytree(resume, tmp / "store" / "simulate_job")  # the server's store of resume states, outside it
    out2 = simulate(
        small_job(tmp, "resumed", resume_from="simulate_job"),
        tmp / "ws2",
        data,
        tmp / "home",
        resume_root=tmp / "store",
    )
    app = app_of(tmp / "ws2")
    if not (app / "FL_global_model.pt").is_file():
        pytest.fail(f"the resumed run left no final model:\n{out2[-4000:]}")
    return {
        "tmp": tmp,
        "data": data,
        "killed": killed,
        "app": app,
        "saved": saved,
        "kept": kept,
        "ws1": tmp / "ws1",
        "ws2": tmp / "ws2",
    }


def test_a_round_with_failed_sites_ran_again_and_the_kill_came_mid_stage_2(runs):
    recs = records(runs["killed"])
    assert [(r["stage"], r["round"], r.get("status")) for r in recs] == [
        (1, 1, "too_few_results"),
        (1, 1, None),
        (2, 1, None),
    ]
    assert recs[0]["sites_answered"] == ["cc-1"]  # cc-2 and uc-hernia failed mid-stage
    assert recs[1]["sites_aggregated"] == SITES  # ... and answered when the round ran again
    assert recs[2]["phase"] == "warm-up" and recs[2]["sites_aggregated"] == ["cc-1", "cc-2"]
    server_log = (runs["ws1"] / "server" / "log.txt").read_text()
    assert "stage 1 round 1 had fewer than 2 valid results (min_clients=2;" in server_log
    assert "running it again" in server_log
    assert not (runs["killed"] / "FL_global_model.pt").exists()
    assert (runs["saved"]["stage"], runs["saved"]["round"]) == (2, 1)
    assert (runs["kept"] / "stage1_ssl.pt").is_file()


def test_the_resumed_run_went_on_from_the_saved_round_without_redoing_a_stage(runs):
    recs = records(runs["app"])
    assert [(r["stage"], r.get("round")) for r in recs] == [(2, 2), (2, 3), (3, None)]  # no stage-1 record
    assert recs[0]["phase"] == "energy" and recs[0]["sites_aggregated"] == SITES
    # the first weights of the resumed run are the interrupted run's last saved ones
    received = torch.load(runs["ws2"] / "cc-1" / "cxrfl_state" / "faults" / "received_train_2.pt", weights_only=True)
    saved = runs["saved"]["params"]
    assert received.keys() == saved.keys() and all(torch.equal(received[k], saved[k]) for k in saved)
    assert not (runs["ws2"] / "cc-1" / "cxrfl_state" / "faults" / "received_train_1.pt").exists()
    stage1 = torch.load(runs["app"] / "fedfew" / "stage1_ssl.pt", weights_only=True)
    assert (
        stage1["ssl_state"].keys()
        and (runs["kept"] / "stage1_ssl.pt").read_bytes() == (runs["app"] / "fedfew" / "stage1_ssl.pt").read_bytes()
    )
    log = (runs["ws2"] / "server" / "log.txt").read_text()
    assert "resume: stage 2 goes on after its round 1" in log and "resume: stage(s) 1-1 loaded" in log


def test_final_checkpoint_is_self_describing(runs):
    ckpt = torch.load(runs["app"] / "FL_global_model.pt", map_location="cpu", weights_only=True)
    assert ckpt["format"] == "cxrfl-checkpoint-v1" and ckpt["method"] == "fedfew"
    assert ckpt["classes"] == [*sorted(FEDFEW_CCS), NO_CC]
    assert any(k.startswith("backbone.") for k in ckpt["model"])  # encoder
    assert ckpt["model"]["classifier.weight"].shape[0] == len(FEDFEW_CCS) + 1  # CC head + "no CC"
    ff = ckpt["fedfew"]
    assert ff["cc_classes"] == sorted(FEDFEW_CCS) and ff["uc_classes"] == ["Hernia"]
    assert isinstance(ff["threshold"], float) and ff["margins"]["chosen"] == "warm-up"
    (pair,) = ff["prototypes"]["Hernia"]
    features = CXRNet(ModelConfig.from_dict(ckpt["model_config"]), 1).backbone.norm5.num_features
    assert pair["positive"].shape == pair["negative"].shape == (features,)  # the feature extractor's
    assert pair["n_positive"] >= 2 and pair["n_negative"] >= 2 and "site" not in pair  # anonymous source
    assert ckpt["model_config"]["image_size"] == 32
    plan = json.loads((runs["app"] / "cxrfl" / "plan.json").read_text())
    assert plan["uc_classes"] == ["Hernia"] and plan["uc_sites"] == {"Hernia": ["uc-hernia"]}


def test_sites_logged_each_stage_and_evaluation_written(runs):
    log = (runs["ws2"] / "uc-hernia" / "log.txt").read_text()
    assert "stage 2 round 2" in log and "sent the prototypes of ['Hernia']" in log
    ev = json.loads((runs["app"] / "cxrfl" / "evaluation.json").read_text())
    assert set(ev["sites"]) == set(SITES)
    assert not (runs["ws2"] / "server" / "cxrfl_resume" / "simulate_job").exists()  # finished: nothing to resume


def test_predict_prints_the_uc_outputs(runs, capsys):
    image = next((runs["data"] / "uc-hernia" / "images").glob("*.png"))
    assert main(["predict", "--model", str(runs["app"] / "FL_global_model.pt"), str(image)]) == 0
    out = capsys.readouterr().out
    assert "Hernia" in out and "energy" in out and "rare class" in out
    assert NO_CC not in out
    assert main(["predict", "--model", str(runs["app"] / "FL_global_model.pt"), str(image), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert set(row["underrepresented"]) == {"Hernia"} and set(row["probabilities"]) == set(FEDFEW_CCS)
