"""End to end: `nvflare simulator jobs/cwt` on three small sites of the real NIH images.

Checks from the controller's records that the model really moves from site to site (the
weights a site starts from are, byte for byte, the weights the previous site returned, as
both the server and the sites hash them) and that a site that is down on its turn is skipped
with a log line while the relay goes on. The third site runs a test-only executor (its own
app in the job, see ``FLAKY``) whose ``train`` task fails in cycle 1.

``resumed``: the simulator (server included) is killed once cycle 1 is recorded; the job
submitted again with ``resume_from`` starts from the saved weights and runs cycle 2 only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, nvflare_bin
from cxrfl.common.io import params_digest, read_records, to_numpy
from cxrfl.common.resume import RESUME_ROOT_ENV, ResumeStore
from cxrfl.cwt.config import BINARY_CLASS
from cxrfl.nn.models import load_checkpoint

pytestmark = pytest.mark.slow

SITES = ("site-1", "site-2", "site-3")
FLAKY = '''
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import make_reply
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from cxrfl.fl.cwt import CWTExecutor


class FlakyCWTExecutor(CWTExecutor):
    """A site that is down on its cycle-1 turn (its train task fails) and healthy otherwise."""

    def execute(self, task_name, shareable, fl_ctx, abort_signal):
        if task_name == "train" and FLModelUtils.from_shareable(shareable).meta.get("cycle") == 1:
            self.log_error(fl_ctx, "simulated outage: site down in cycle 1")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        return super().execute(task_name, shareable, fl_ctx, abort_signal)
'''


def nih_site_configs(shared: Path, out: Path) -> None:
    """Three sites of about 30 real NIH images each (whole patients), NIH format, 60/20/20 patient split."""
    source = shared / "nih1000" / "Data_Entry_2017_v2020.csv"
    lines = source.read_text().splitlines()
    header, rows = lines[0], lines[1:]
    patients: dict[str, list[str]] = {}
    for row in rows:
        patients.setdefault(row.split(",")[3], []).append(row)
    small = [p for p, r in sorted(patients.items()) if len(r) <= 3]
    out.mkdir(parents=True, exist_ok=True)
    for i, site in enumerate(SITES):
        chosen = [r for p in small[i * 15 : (i + 1) * 15] for r in patients[p]]
        (out / f"{site}.csv").write_text("\n".join([header, *chosen]) + "\n")
        (out / f"{site}.yaml").write_text(
            f"site: {site}\n"
            f"dataset: {{format: nih, labels: {out / f'{site}.csv'}, images: {shared / 'nih1000' / 'images'}}}\n"
            "split: {train: 0.6, val: 0.2, test: 0.2, seed: 0}\n"
        )


def small_job(repo_root: Path, out: Path, *, flaky: bool = True, cycles: int = 2, **server_args) -> Path:
    """jobs/cwt with ``cycles`` cycles of 1 step per site (the tiny network at 32x32) and, with ``flaky``, a
    flaky third site."""
    job = out / "cwt"
    shutil.copytree(repo_root / "jobs" / "cwt", job)
    cfg_path = job / "app" / "config" / "config_fed_server.json"
    cfg = json.loads(cfg_path.read_text())
    args = cfg["workflows"][0]["args"]
    args["cwt_config"].update(num_cycles=cycles, local_steps=1, batch_size=8, augment=False, patience=5, plti=False)
    args["model_config"].update(TINY_MODEL)
    args.update(task_timeout=600, **server_args)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    client_path = job / "app" / "config" / "config_fed_client.json"
    client = json.loads(client_path.read_text())
    client["executors"][0]["executor"]["args"]["num_threads"] = 1  # a shared 2-core machine
    client_path.write_text(json.dumps(client, indent=2))
    if not flaky:
        return job
    flaky_app = job / "app_flaky"
    (flaky_app / "config").mkdir(parents=True)
    (flaky_app / "custom").mkdir()
    (flaky_app / "custom" / "flaky_cwt.py").write_text(FLAKY)
    client["executors"][0]["executor"]["path"] = "flaky_cwt.FlakyCWTExecutor"
    (flaky_app / "config" / "config_fed_client.json").write_text(json.dumps(client, indent=2))
    meta = json.loads((job / "meta.json").read_text())
    meta["deploy_map"] = {"app": ["server", "site-1", "site-2"], "app_flaky": ["site-3"]}
    (job / "meta.json").write_text(json.dumps(meta, indent=2))
    return job


def simulate(
    job: Path,
    ws: Path,
    configs: Path,
    sites: tuple[str, ...],
    *,
    kill_after_cycle: int | None = None,
    timeout: float = 900,
    resume_root: Path | None = None,
) -> subprocess.CompletedProcess | None:
    """Run the simulator; with ``kill_after_cycle``, kill its whole process group once that cycle is recorded;
    ``resume_root``: the server's folder of resume states (the simulator replaces its workspace every run)."""
    env = {**os.environ, "CXRFL_SITE_CONFIG_DIR": str(configs), "HOME": str(ws.parent / "home")}
    if resume_root is not None:
        env[RESUME_ROOT_ENV] = str(resume_root)
    env.pop("CXRFL_SITE_CONFIG", None)
    cmd = [
        nvflare_bin(),
        "simulator",
        str(job),
        "-w",
        str(ws),
        "-c",
        ",".join(sites),
        "-t",
        str(len(sites)),
    ]
    if kill_after_cycle is None:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    cycles = ws / "server" / "simulate_job" / "app_server" / "cxrfl" / "cycles.jsonl"
    with open(ws.parent / f"{ws.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if any(c.get("cycle") == kill_after_cycle and c.get("status") == "completed" for c in read_records(cycles)):
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.5)
        proc.wait(timeout=60)
    return None


@pytest.fixture(scope="module")
def configs(tmp_path_factory, shared_data) -> Path:
    out = tmp_path_factory.mktemp("cwt_configs")
    nih_site_configs(shared_data, out)
    return out


@pytest.fixture(scope="module")
def simulated(tmp_path_factory, repo_root, configs):
    tmp = tmp_path_factory.mktemp("cwt_sim")
    job = small_job(repo_root, tmp)
    ws = tmp / "ws"
    proc = simulate(job, ws, configs, SITES)
    app = ws / "server" / "simulate_job" / "app_server"
    if not (app / "cxrfl" / "evaluation.json").is_file():
        pytest.fail(f"simulator did not finish (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    visits = [json.loads(x) for x in (app / "cxrfl" / "visits.jsonl").read_text().splitlines()]
    return {"ws": ws, "app": app, "proc": proc, "visits": visits}


def test_relay_order_and_the_skipped_site(simulated):
    visits = simulated["visits"]
    assert [(v["cycle"], v["site"], v["status"]) for v in visits] == [
        (1, "site-1", "trained"),
        (1, "site-2", "trained"),
        (1, "site-3", "skipped"),
        (2, "site-1", "trained"),
        (2, "site-2", "trained"),
        (2, "site-3", "trained"),
    ]
    assert "failed or timed out" in visits[2]["reason"]
    server_log = (simulated["ws"] / "server" / "log.txt").read_text()
    assert (
        "cycle 1: site site-3 skipped (its task failed or timed out, or the site is down); the model goes on to "
        "the next site unchanged"
    ) in server_log
    cycles = read_records(simulated["app"] / "cxrfl" / "cycles.jsonl")
    assert [(c["cycle"], c["status"]) for c in cycles] == [(1, "completed"), (2, "completed")]
    assert cycles[0]["trained"] == ["site-1", "site-2"] and set(cycles[0]["skipped"]) == {"site-3"}
    assert cycles[1]["trained"] == list(SITES)


def test_weights_after_site_k_are_the_starting_weights_of_site_k_plus_1(simulated):
    trained = [v for v in simulated["visits"] if v["status"] == "trained"]
    assert trained[0]["site_received_digest"] == trained[0]["sent_digest"]  # the initial model arrived intact
    for v in trained:
        assert v["site_returned_digest"] == v["received_digest"]  # what the site sent is what the server got
        assert v["site_returned_digest"] != v["site_received_digest"]  # and the site really trained it
        assert v["metrics"]["steps"] == 1
    for prev, nxt in zip(trained, trained[1:]):
        assert nxt["sent_digest"] == prev["received_digest"]
        assert nxt["site_received_digest"] == prev["site_returned_digest"], (prev["site"], nxt["site"])
    skipped = next(v for v in simulated["visits"] if v["status"] == "skipped")
    assert skipped["sent_digest"] == trained[1]["received_digest"]  # site-3 was offered site-2's weights ...
    assert trained[2]["sent_digest"] == trained[1]["received_digest"]  # ... and site-1 got them unchanged


def test_outputs_are_self_describing(simulated):
    app = simulated["app"]
    ckpt = torch.load(app / "FL_global_model.pt", map_location="cpu", weights_only=False)
    assert ckpt["classes"] == [BINARY_CLASS] and ckpt["cycle"] == 2 and ckpt["method"] == "CWT"
    assert ckpt["model"]["classifier.weight"].shape[0] == 1
    assert not any(k.startswith("__optimizer__") for k in ckpt["model"])
    best = torch.load(app / "best_FL_global_model.pt", map_location="cpu", weights_only=False)
    completed = [r for r in read_records(app / "cxrfl" / "cycles.jsonl") if r["status"] == "completed"]
    assert [r["cycle"] for r in completed] == [1, 2]
    first, second = (r["val_loss"] for r in completed)
    lowest = completed[1] if second < first - 1e-4 else completed[0]  # min_delta: smaller gains do not count
    assert best["classes"] == [BINARY_CLASS] and best["cycle"] == lowest["cycle"]
    plan = json.loads((app / "cxrfl" / "plan.json").read_text())
    assert set(plan["sites"]) == set(SITES) and all(p["steps"] == 1 for p in plan["sites"].values())
    ev = json.loads((app / "cxrfl" / "evaluation.json").read_text())
    assert set(ev["sites"]) == set(SITES) and ev["best_cycle"] == lowest["cycle"]
    for m in ev["sites"].values():
        assert m["n"] > 0 and abs(m["accuracy"] * m["n"] - round(m["accuracy"] * m["n"])) < 1e-6  # correct / n
    site_log = (simulated["ws"] / "site-1" / "log.txt").read_text()
    assert "site site-1 cycle 2 visit 1: 1 steps" in site_log


# ---------------------------------------------------------------- server killed, job resumed
@pytest.fixture(scope="module")
def resumed(tmp_path_factory, repo_root, configs):
    tmp = tmp_path_factory.mktemp("cwt_resume")
    sites = SITES[:2]
    ws1, ws2 = tmp / "ws1", tmp / "ws2"
    first = small_job(repo_root, tmp / "first", flaky=False, cycles=3, evaluate_test=False)
    simulate(first, ws1, configs, sites, kill_after_cycle=1)
    state = ws1 / "server" / "cxrfl_resume" / "simulate_job"
    shutil.copytree(state, tmp / "store" / "simulate_job")  # the server's store outlives the simulator's workspace
    second = small_job(
        repo_root, tmp / "second", flaky=False, cycles=3, evaluate_test=False, resume_from="simulate_job"
    )
    proc = simulate(second, ws2, configs, sites, resume_root=tmp / "store")
    saved = ResumeStore.read(state / "state.pt")
    return {
        "state": state,
        "saved": saved,
        "ws1": ws1,
        "ws2": ws2,
        "proc": proc,
        "app1": ws1 / "server" / "simulate_job" / "app_server",
        "app2": ws2 / "server" / "simulate_job" / "app_server",
    }


def test_the_killed_relay_left_its_last_completed_cycle(resumed):
    saved = resumed["saved"]
    first = read_records(resumed["app1"] / "cxrfl" / "cycles.jsonl")
    assert 1 <= saved["cycle"] < 3 and saved["iteration"] == 2 * saved["cycle"]  # 2 sites x 1 step per cycle
    assert max(c["cycle"] for c in first if c["status"] == "completed") <= saved["cycle"]  # a recorded cycle is kept
    assert load_checkpoint(resumed["app1"] / "FL_global_model.pt")["cycle"] >= saved["cycle"]  # readable, not older
    assert not (resumed["app1"] / "cxrfl" / "evaluation.json").exists()


def test_the_resumed_relay_starts_from_the_saved_weights_and_ends_as_an_uninterrupted_run(resumed):
    saved, app = resumed["saved"], resumed["app2"]
    cycles = read_records(app / "cxrfl" / "cycles.jsonl")
    assert cycles, resumed["proc"].stdout[-3000:] + resumed["proc"].stderr[-3000:]
    done = saved["cycle"]
    assert [(c["cycle"], c["status"]) for c in cycles] == [(done, "resumed")] + [
        (c, "completed") for c in range(done + 1, 4)
    ]
    visits = read_records(app / "cxrfl" / "visits.jsonl")
    assert visits[0]["cycle"] == done + 1  # no completed cycle redone
    assert visits[0]["sent_digest"] == visits[0]["site_received_digest"] == params_digest(to_numpy(saved["weights"]))
    assert visits[0]["iteration"] == saved["iteration"]  # the learning-rate schedule goes on where it stopped
    assert load_checkpoint(app / "FL_global_model.pt")["cycle"] == 3  # num_cycles, as without the interruption
    assert not (resumed["ws2"] / "server" / "cxrfl_resume" / "simulate_job").exists()  # finished: state removed
