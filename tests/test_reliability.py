"""Faults injected for real in `nvflare simulator` runs of jobs/surgical_agg (issue 8).

- ``faulty``: six sites. hospital-a and hospital-b train; bad-1..3 send a differently malformed
  result in each round (NaN, Inf, wrong shape, missing / extra keys, a class never announced,
  duplicated class names, zero / negative sample counts); in round 2 every site's first answer
  is malformed, so the round has no valid result and is run again; hospital-b has corrupt,
  truncated and missing images within its ``max_bad_fraction``; bad-4 reads the same data with
  a lower ``max_bad_fraction`` and stops at start with a clear error; bad-1's head warm-up
  fails, so it gets it again in round 1's exchange and joins from round 2 (bad-4 gets it in every
  round, in vain).
- ``interrupted`` / ``resumed``: the simulator (server included) is killed after round 1; a
  second job with ``resume_from`` finishes rounds 2 and 3 without redoing round 1, starting from
  the weights the first job saved (what the sites receive is compared as tensors).
- ``starved``: a round never gets ``min_clients`` valid results: the job stops with the reason
  and keeps the warm-up model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL, app_of, nvflare_bin
from cxrfl.common.io import read_records
from cxrfl.common.resume import RESUME_ROOT_ENV, ResumeStore
from cxrfl.data.labels import KNOWN_CLASSES, NIH_CLASSES
from cxrfl.nn.models import load_checkpoint
from cxrfl.surgical.head_modes import site_payload
from cxrfl.synth import write_profile

pytestmark = pytest.mark.slow

FAULTS = {
    "bad-1": {"warmup": "raise", "2": "inf", "3": "duplicate"},  # joins late: in round 1 it warms up
    "bad-2": {"1": "shape", "2": "missing_key", "3": "zero_samples"},
    "bad-3": {"1": "extra_key", "2": "unannounced", "3": "negative_samples"},
    "hospital-a": {"2": "nan"},
    "hospital-b": {"2": "shape", "4": "raise"},
}
REASONS = {  # words of the rejection each fault must produce
    "nan": "non-finite",
    "inf": "non-finite",
    "shape": "has shape",
    "missing_key": "missing parameter",
    "extra_key": "unexpected parameter",
    "unannounced": "never announced",
    "duplicate": "duplicate class names",
    "zero_samples": "num_samples",
    "negative_samples": "num_samples",
}
REJECTED = {site: {r: f for r, f in rounds.items() if f != "raise"} for site, rounds in FAULTS.items()}
SMALL_TRAIN = {"warmup_epochs": 1, "batch_size": 8, "max_steps_per_epoch": 2}
FAULTY_EXECUTOR = Path(__file__).parent / "faults" / "faulty_executor.py"


def make_job(
    repo_root: Path,
    out: Path,
    *,
    faults: dict | None = None,
    echo: list | None = None,
    keep_received: list | None = None,
    **server_args,
) -> Path:
    """jobs/surgical_agg with small settings (the tiny network); with ``faults``, every site runs the FaultyExecutor."""
    job = out / "surgical_agg"
    shutil.copytree(repo_root / "jobs" / "surgical_agg", job)
    cfg_path = job / "app" / "config" / "config_fed_server.json"
    cfg = json.loads(cfg_path.read_text())
    args = cfg["workflows"][0]["args"]
    args["model_config"].update(TINY_MODEL)
    args["train_config"].update(SMALL_TRAIN)
    args.update(server_args)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    if faults is not None:
        shutil.copy(FAULTY_EXECUTOR, job / "app" / "custom" / FAULTY_EXECUTOR.name)
        client_path = job / "app" / "config" / "config_fed_client.json"
        client = json.loads(client_path.read_text())
        executor = client["executors"][0]["executor"]
        executor["path"] = "faulty_executor.FaultyExecutor"
        executor["args"].update(faults=faults, echo=echo or [], keep_received=keep_received or [])
        client_path.write_text(json.dumps(client, indent=2))
    return job


def simulate(
    job: Path,
    ws: Path,
    sites: list[str],
    data: Path,
    *,
    kill_after_round: int | None = None,
    timeout: float = 900,
    resume_root: Path | None = None,
) -> subprocess.CompletedProcess | None:
    """Run the simulator; with ``kill_after_round``, kill its whole process group once that round is recorded;
    ``resume_root``: the server's folder of resume states (the simulator replaces its workspace every run)."""
    env = {**os.environ, "CXRFL_SITE_CONFIG_DIR": str(data), "HOME": str(ws.parent / "home")}
    if resume_root is not None:
        env[RESUME_ROOT_ENV] = str(resume_root)
    # a worker per site: the simulator never swaps a site's app out between turns
    cmd = [nvflare_bin(), "simulator", str(job), "-w", str(ws), "-c", ",".join(sites), "-t", str(len(sites))]
    if kill_after_round is None:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    log = open(ws.parent / f"{ws.name}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rounds = ws / "server" / "simulate_job" / "app_server" / "cxrfl" / "rounds.jsonl"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if any(r.get("round") == kill_after_round and r.get("aggregated") for r in read_records(rounds)):
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.5)
        proc.wait(timeout=60)
    finally:
        log.close()
    return None


def site_log(ws: Path, site: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in (ws / site).rglob("log.txt"))


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reliability_data")
    configs = {
        p.stem: p
        for p in write_profile("two-hospitals", root, n_per_site=60, image_size=32, sites=["hospital-a", "hospital-b"])
    }
    for name in ("bad-1", "bad-2", "bad-3"):
        text = configs["hospital-a"].read_text().replace("site: hospital-a", f"site: {name}")
        (root / f"{name}.yaml").write_text(text)
    # hospital-b: one truncated, one garbage and one missing image (within its max_bad_fraction of 10%)
    images = sorted((root / "hospital-b").rglob("*.png")) + sorted((root / "hospital-b").rglob("*.jpg"))
    images[0].write_bytes(images[0].read_bytes()[:40])
    images[1].write_bytes(b"this is not an image")
    images[2].unlink()
    text = configs["hospital-b"].read_text()
    configs["hospital-b"].write_text(text + "max_bad_fraction: 0.1\n")
    (root / "bad-4.yaml").write_text(text.replace("site: hospital-b", "site: bad-4") + "max_bad_fraction: 0.01\n")
    return root


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, repo_root, data):
    tmp = tmp_path_factory.mktemp("faulty")
    job = make_job(
        repo_root,
        tmp,
        faults=FAULTS,
        echo=["bad-1", "bad-2", "bad-3"],
        num_rounds=4,
        patience=10,
        min_clients=2,
        evaluate_test=False,
        retry_pause=1,
    )
    ws = tmp / "ws"
    proc = simulate(job, ws, ["hospital-a", "hospital-b", "bad-1", "bad-2", "bad-3", "bad-4"], data)
    app = app_of(ws)
    if not (app / "cxrfl" / "rounds.jsonl").is_file():
        pytest.fail(
            f"simulator wrote no round record (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return {"ws": ws, "app": app, "proc": proc, "records": read_records(app / "cxrfl" / "rounds.jsonl")}


# ------------------------------------------------------------------ malformed results
def test_every_malformed_result_is_rejected_with_its_site_and_reason(faulty):
    train = [r for r in faulty["records"] if r["phase"] == "train"]
    first = {}
    for r in train:
        first.setdefault(r["round"], r)  # the first attempt of each round
    for site, rounds in REJECTED.items():
        for rnd, fault in rounds.items():
            rejected = first[int(rnd)]["rejected"]
            assert site in rejected, (site, rnd, fault, rejected)
            assert rejected[site].startswith(f"site {site}:") and REASONS[fault] in rejected[site], rejected[site]
    log = (faulty["ws"] / "server").rglob("log.txt")
    server_log = "\n".join(p.read_text(errors="replace") for p in log)
    for site in ("bad-1", "bad-2", "bad-3"):
        assert server_log.count(f"rejected result: site {site}:") == len(REJECTED[site]), site


def test_valid_results_are_aggregated_beside_the_rejected_ones(faulty):
    by_round = [
        (r["round"], r["aggregated"], r["sites_aggregated"]) for r in faulty["records"] if r["phase"] == "train"
    ]
    assert by_round[0] == (1, True, ["hospital-a", "hospital-b"])
    assert by_round[-2] == (3, True, ["hospital-a", "hospital-b"])
    for r in faulty["records"]:
        if r.get("aggregated"):  # the final validation record aggregates nothing
            for c in NIH_CLASSES:
                assert set(r["contributors"][c]) <= set(r["sites_aggregated"])
            assert set(r["contributors"].get("Fracture", [])) <= {"hospital-b"}  # bad-3's unannounced row never counts


def test_a_round_without_valid_results_keeps_the_model_and_runs_again(faulty):
    round2 = [r for r in faulty["records"] if r["round"] == 2 and r["phase"] == "train"]
    assert [r["aggregated"] for r in round2] == [False, True]
    assert round2[0]["sites_aggregated"] == [] and len(round2[0]["rejected"]) == 5
    assert round2[1]["sites_aggregated"] == ["bad-1", "bad-2", "bad-3", "hospital-a", "hospital-b"]
    checkpoints = sorted(p.name for p in (faulty["app"] / "cxrfl" / "checkpoints").iterdir())
    assert checkpoints == ["round_001.pt", "round_002.pt", "round_003.pt", "round_004.pt"]


def test_every_checkpoint_is_complete_and_finite(faulty):
    for path in sorted((faulty["app"] / "cxrfl" / "checkpoints").iterdir()) + [faulty["app"] / "FL_global_model.pt"]:
        ckpt = load_checkpoint(path)
        assert ckpt["classes"] == list(KNOWN_CLASSES)
        assert all(torch.isfinite(t).all() for t in ckpt["model"].values() if t.is_floating_point()), path
    assert load_checkpoint(faulty["app"] / "FL_global_model.pt")["round"] == 4


def test_an_exception_in_a_site_task_leaves_that_site_out_of_the_round(faulty):
    round4 = [r for r in faulty["records"] if r["round"] == 4 and r["phase"] == "train"]
    assert len(round4) == 1 and round4[0]["aggregated"]
    assert round4[0]["sites_failed"] == ["hospital-b"]
    assert round4[0]["sites_aggregated"] == ["bad-1", "bad-2", "bad-3", "hospital-a"]
    assert "site hospital-b: task train failed: injected failure in round 4" in site_log(faulty["ws"], "hospital-b")


# --------------------------------------------------------------------------- bad data
def test_bad_images_are_skipped_and_counted_within_the_threshold(faulty):
    log = site_log(faulty["ws"], "hospital-b")
    assert "3 skipped" in log
    records = faulty["records"]
    assert all(
        "hospital-b" in r["sites_answered"] for r in records if r["phase"] in ("warmup", "train") and r["round"] < 4
    )


def test_classes_without_validation_positives_are_reported_before_training(faulty):
    lines = site_log(faulty["ws"], "hospital-b").splitlines()
    reported = [i for i, line in enumerate(lines) if "has no positive image in split(s) val" in line]
    first_task = next(i for i, line in enumerate(lines) if "task_name=train" in line)
    assert reported and min(reported) < first_task  # at start


def test_a_site_over_the_bad_image_threshold_stops_at_start_and_the_others_go_on(faulty):
    log = site_log(faulty["ws"], "bad-4")
    assert "cannot take part" in log and "max_bad_fraction" in log
    assert re.search(r"3 of \d+ images of site 'bad-4' are missing or unreadable", log), log[-2000:]
    assert faulty["records"][0]["phase"] == "warmup" and faulty["records"][0]["sites_failed"] == ["bad-1", "bad-4"]
    for r in faulty["records"]:  # sent the warm-up in every round, it never answers
        assert "bad-4" not in r["sites_answered"]
    assert load_checkpoint(faulty["app"] / "FL_global_model.pt")["round"] == 4


def test_a_site_whose_warmup_failed_joins_at_a_later_round(faulty):
    records = faulty["records"]
    joins = [r for r in records if r["phase"] == "join"]
    assert [r["round"] for r in joins] == [r["round"] for r in records if r["phase"] == "train"]  # every attempt
    assert (joins[0]["round"], joins[0]["joined"], joins[0]["sites_failed"]) == (1, ["bad-1"], ["bad-4"])
    assert all(r["joined"] == [] and r["sites_asked"] == ["bad-4"] for r in joins[1:])
    train = [r for r in records if r["phase"] == "train"]
    assert "bad-1" not in train[0]["sites_answered"] and "bad-1" in train[1]["sites_answered"]  # rounds 1 and 2
    assert "site bad-1: task train failed: injected warm-up failure" in site_log(faulty["ws"], "bad-1")
    assert load_checkpoint(faulty["app"] / "FL_global_model.pt")["classes"] == list(KNOWN_CLASSES)


# ---------------------------------------------------------------- server interrupted
@pytest.fixture(scope="module")
def resumed(tmp_path_factory, repo_root, data):
    tmp = tmp_path_factory.mktemp("resume")
    sites = ["hospital-a", "hospital-b"]
    first = make_job(repo_root, tmp / "first", num_rounds=3, patience=10, evaluate_test=False)
    ws1 = tmp / "ws1"
    simulate(first, ws1, sites, data, kill_after_round=1)
    state = ws1 / "server" / "cxrfl_resume" / "simulate_job"
    saved = ResumeStore.read(state / "state.pt")  # before the second job runs
    store = tmp / "store"  # resume_from is a job id of the server's store, which outlives the simulator's workspace
    shutil.copytree(state, store / "simulate_job")
    second = make_job(
        repo_root,
        tmp / "second",
        faults={},
        keep_received=sites,
        num_rounds=3,
        patience=10,
        evaluate_test=False,
        resume_from="simulate_job",
    )
    ws2 = tmp / "ws2"
    proc = simulate(second, ws2, sites, data, resume_root=store)
    return {
        "ws1": ws1,
        "ws2": ws2,
        "state": state,
        "saved": saved,
        "proc": proc,
        "first": read_records(app_of(ws1) / "cxrfl" / "rounds.jsonl"),
        "second": read_records(app_of(ws2) / "cxrfl" / "rounds.jsonl"),
    }


def test_the_killed_run_stopped_after_round_1_and_left_its_state(resumed):
    assert [r["round"] for r in resumed["first"]][:2] == [0, 1]
    assert (resumed["state"] / "state.pt").is_file()
    assert not (app_of(resumed["ws1"]) / "cxrfl" / "evaluation.json").exists()


def test_the_resumed_run_goes_on_from_the_last_completed_round(resumed):
    second = resumed["second"]
    assert second, resumed["proc"].stdout[-3000:] + resumed["proc"].stderr[-3000:]
    done = max(r["round"] for r in resumed["first"] if r.get("aggregated"))
    assert second[0]["phase"] == "resumed" and second[0]["round"] == done
    assert [r["round"] for r in second if r["phase"] == "train"] == list(range(done + 1, 4))  # none redone
    assert not any(r["phase"] == "warmup" for r in second)
    ckpt = load_checkpoint(app_of(resumed["ws2"]) / "FL_global_model.pt")
    assert ckpt["round"] == 3 and ckpt["classes"] == list(KNOWN_CLASSES)
    assert not (resumed["ws2"] / "server" / "cxrfl_resume" / "simulate_job").exists()  # finished: state removed


def test_the_resumed_run_starts_from_the_interrupted_model(resumed):
    saved = resumed["saved"]
    last = load_checkpoint(app_of(resumed["ws1"]) / "cxrfl" / "checkpoints" / f"round_{saved['round']:03d}.pt")
    for site, classes in saved["announced"].items():
        files = list((resumed["ws2"] / site).rglob(f"received_round_{saved['round'] + 1}.pt"))
        assert len(files) == 1, files
        received = torch.load(files[0], weights_only=False)  # what the site got in the resumed job's first round
        expected = site_payload(last["model"], last["classes"], classes)
        assert received.keys() == expected.keys()
        for k, v in expected.items():
            np.testing.assert_array_equal(received[k], v.numpy(), err_msg=k)
            np.testing.assert_array_equal(
                received[k], site_payload(saved["params"], saved["classes"], classes)[k], err_msg=k
            )


# ------------------------------------------------------------ too few sites: clear stop
def test_a_round_that_never_reaches_min_clients_stops_the_job_with_the_reason(tmp_path, repo_root, data):
    job = make_job(
        repo_root,
        tmp_path,
        faults={"hospital-b": {"1": "nan"}},
        num_rounds=2,
        min_clients=2,
        min_clients_timeout=0,
        evaluate_test=False,
    )
    ws = tmp_path / "ws"
    proc = simulate(job, ws, ["hospital-a", "hospital-b"], data)
    records = read_records(app_of(ws) / "cxrfl" / "rounds.jsonl")
    assert [(r["round"], r["phase"]) for r in records] == [(0, "warmup"), (1, "train"), (1, "stopped")], proc.stdout[
        -3000:
    ]
    reason = records[-1]["reason"]
    assert "min_clients=2" in reason and "hospital-b" in reason and "resume_from" in reason
    assert load_checkpoint(app_of(ws) / "FL_global_model.pt")["round"] == 0  # the warm-up model, never half-aggregated
    assert not (app_of(ws) / "cxrfl" / "checkpoints").exists()
    assert (ws / "server" / "cxrfl_resume" / "simulate_job" / "state.pt").is_file()
    server_log = "\n".join(p.read_text(errors="replace") for p in (ws / "server").rglob("log.txt"))
    assert "stopping: round 1 had fewer than min_clients=2" in server_log
