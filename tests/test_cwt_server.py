"""The CWT relay server (cxrfl.cwt.server.CWTServer) in one process: the loop the NVFlare job runs.

Sites are tiny (densenet-tiny, 32x32 noise images, one optimiser step per visit); faults and validation losses
are scripted by host wrappers (tests/cwt_helpers.py).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from cwt_helpers import Failing, Recorder, ScriptedLoss, chain, tiny_site
from cxrfl.common.io import params_digest, read_records
from cxrfl.common.resume import ResumeStore
from cxrfl.common.server import BEST_MODEL, RunAborted, RunStopped
from cxrfl.cwt.config import BINARY_CLASS, OPTIMIZER_PREFIX, CWTConfig, RelayConfig
from cxrfl.cwt.inprocess import run_cwt
from cxrfl.cwt.site import make_sites
from cxrfl.nn.models import ModelConfig, load_checkpoint, model_from_checkpoint
from pooling_helpers import central_auroc

MODEL = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here


class Crash(BaseException):
    """The server process dies (not an Exception: no transport catches it)."""


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def datas(tmp_path):
    splits = ["train"] * 6 + ["val"] * 2 + ["test"] * 2
    a = tiny_site(
        tmp_path, "site-a", {"Effusion": [1, 0, 0, 1, 0, 0, 1, 0, 1, 0], "Mass": [0, 0, 1, 0, 0, 1, 0, 1, 0, 1]}, splits
    )
    b = tiny_site(
        tmp_path, "site-b", {"Mass": [1, 1, 0, 0, 0, 0, 1, 0, 0, 1], "Nodule": [0, 1, 0, 0, 1, 0, 0, 1, 1, 0]}, splits
    )
    return [a, b]


def config(**changes) -> CWTConfig:
    return CWTConfig(**{"num_cycles": 2, "batch_size": 4, "local_steps": 1, "augment": False, "patience": 5, **changes})


def run(datas, cfg: CWTConfig, out=None, *, wrap=None, relay=None, **kw):
    return run_cwt(make_sites(datas, cfg, MODEL), cfg, out, model_config=MODEL, wrap=wrap, relay=relay, **kw)


def recorder(log: list):
    return lambda name, host: Recorder(host, name, log)


def down(site: str, cycles: set[int], error=RuntimeError):
    """``site``'s train task raises in ``cycles`` (each attempt)."""
    return lambda name, host: (
        Failing(
            host,
            lambda task, meta: name == site and task == "train" and meta["cycle"] in cycles,
            lambda: error("site is down"),
        )
        if name == site
        else host
    )


def scripted(losses: dict[int, float]):
    return lambda name, host: ScriptedLoss(host, losses)


def records(out, name):
    return read_records(out / "cxrfl" / name)


def weights(params: dict) -> dict:
    return {k: v for k, v in params.items() if not k.startswith(OPTIMIZER_PREFIX)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def ckpt_equals(path, params: dict) -> bool:
    model = load_checkpoint(path)["model"]
    return same({k: v.numpy() for k, v in model.items()}, weights(params))


# ------------------------------------------------------------------------------------- relay
def test_weights_after_site_k_are_the_start_of_site_k_plus_1_and_a_down_site_is_skipped(datas, tmp_path, caplog):
    log: list = []
    out = tmp_path / "out"
    result = run(datas, config(), out, wrap=chain(down("site-b", {1}), recorder(log)))
    assert [(c, s) for c, s, _, _ in log] == [(1, "site-a"), (2, "site-a"), (2, "site-b")]
    for (_, _, _, left), (_, _, arrived, _) in zip(log, log[1:]):
        assert same(arrived, left)  # weights and Adam's state: what left one site is what the next one trains
    assert all(not same(weights(received), weights(returned)) for _, _, received, returned in log)  # each trained
    assert any(k.startswith(OPTIMIZER_PREFIX) for k in log[1][2])  # Adam's state travels (optimizer_state: travel)
    visits = records(out, "visits.jsonl")
    assert [(v["cycle"], v["site"], v["status"]) for v in visits] == [
        (1, "site-a", "trained"),
        (1, "site-b", "skipped"),
        (2, "site-a", "trained"),
        (2, "site-b", "trained"),
    ]
    assert "failed or timed out" in visits[1]["reason"]
    assert visits[1]["sent_digest"] == visits[0]["received_digest"] == visits[2]["sent_digest"]  # went on unchanged
    for v in (visits[0], visits[2], visits[3]):
        assert v["site_received_digest"] == v["sent_digest"] and v["site_returned_digest"] == v["received_digest"]
    assert visits[3]["received_digest"] == params_digest(weights(log[-1][3]))
    cycles = records(out, "cycles.jsonl")
    assert [(c["cycle"], c["status"], c["trained"]) for c in cycles] == [
        (1, "completed", ["site-a"]),
        (2, "completed", ["site-a", "site-b"]),
    ]
    assert ckpt_equals(out / "FL_global_model.pt", log[-1][3])  # the final model is what the last site returned
    assert result.classes == [BINARY_CLASS] and result.cycles_run == 2
    plan = json.loads((out / "cxrfl" / "plan.json").read_text())
    assert plan["relay"] == ["site-a", "site-b"] and plan["sites"]["site-a"]["steps"] == 1
    assert not (out / "cxrfl_resume" / "run").exists()  # finished: nothing to resume


def test_an_unusable_result_is_skipped_and_the_model_goes_on_unchanged(datas, tmp_path):
    class NaNWeights(Recorder):
        def handle(self, task, params, meta):
            out, answer = self.host.handle(task, params, meta)
            if task == "train" and meta["cycle"] == 1:
                out = {k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v for k, v in out.items()}
            return out, answer

    log: list = []
    out = tmp_path / "out"
    run(
        datas,
        config(num_cycles=1),
        out,
        wrap=chain(lambda n, h: NaNWeights(h, n, []) if n == "site-a" else h, recorder(log)),
    )
    visits = records(out, "visits.jsonl")
    assert (
        visits[0]["status"] == "skipped"
        and "unusable result" in visits[0]["reason"]
        and "non-finite" in visits[0]["reason"]
    )
    assert visits[1]["sent_digest"] == visits[0]["sent_digest"]  # site-b got the model site-a was sent


def _norm(received: dict, returned: dict) -> float:
    """Hand-computed L2 change over the float weights (Adam's travelling state is not the model)."""
    received, returned = weights(received), weights(returned)
    floats = [k for k in received if received[k].dtype.kind == "f"]
    return math.sqrt(sum(np.sum((returned[k].astype(np.float64) - received[k]) ** 2) for k in floats))


def test_each_visit_records_its_update_norm_and_a_scaled_site_is_named_in_a_warning(datas, tmp_path, caplog):
    # issue 40 point 3 for CWT: the model a site returns goes on to the next site whatever its scale; the
    # visit record keeps the norm of the site's change and a warning names a site 10x above the cycle's median
    class Scaled(Recorder):
        def handle(self, task, params, meta):
            out, answer = self.host.handle(task, params, meta)
            if task == "train":
                scale = {k: v.dtype.kind == "f" and "running_" not in k for k, v in out.items()}  # variances stay >= 0
                out = {k: params[k] + 1e4 * (v - params[k]) if scale[k] else v for k, v in out.items()}
            return out, answer

    splits = ["train"] * 6 + ["val"] * 2 + ["test"] * 2
    third = tiny_site(tmp_path, "site-c", {"Mass": [0, 1, 1, 0, 0, 1, 0, 0, 1, 0]}, splits)
    log: list = []
    out = tmp_path / "out"
    scaled = lambda n, h: Scaled(h, n, []) if n == "site-c" else h  # noqa: E731
    run([*datas, third], config(num_cycles=1), out, wrap=chain(scaled, recorder(log)))
    norms = {v["site"]: v["update_norm"] for v in records(out, "visits.jsonl")}
    assert norms == pytest.approx({site: _norm(received, returned) for _, site, received, returned in log}, rel=1e-5)
    median = sorted(norms.values())[1]
    assert norms["site-c"] > 10 * median
    lines = [r.getMessage() for r in caplog.records if "update norm" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("cycle 1: site site-c: its update norm")


def test_shuffled_multilabel_relay_with_evaluation(datas, tmp_path):
    out = tmp_path / "out"
    cfg = config(task="multilabel", order="shuffled", num_cycles=2, seed=4)  # seed 4 draws b > a, then a > b
    result = run(datas, cfg, out, relay=RelayConfig(evaluate_test=True, min_sites_timeout=0))
    assert [c["order"] for c in records(out, "cycles.jsonl")] == [["site-b", "site-a"], ["site-a", "site-b"]]
    assert result.classes == ["Effusion", "Mass", "Nodule"]
    ev = json.loads((out / "cxrfl" / "evaluation.json").read_text())
    assert ev["classes"] == result.classes and ev["best_cycle"] == result.best_cycle
    assert set(ev["sites"]) == {"site-a", "site-b"} and math.isfinite(ev["pooled_loss"])
    assert set(ev["sites"]["site-a"]["auroc"]) == set(result.classes)


def test_the_final_test_evaluation_is_pooled_per_class_over_the_sites_that_label_it(datas, tmp_path):
    # issue 45: a training job's final evaluation uses the evaluation-only federation's code; CWT's too
    out = tmp_path / "out"
    cfg = config(task="multilabel", precision="fp32")
    relay = RelayConfig.from_dict({"evaluate_test": True, "min_sites_timeout": 0, "pooled": {"min_cell": 1}})
    run(datas, cfg, out, relay=relay)
    pooled = json.loads((out / "cxrfl" / "evaluation.json").read_text())["pooled"]["classes"]
    assert pooled["Mass"]["sites_pooled"] == ["site-a", "site-b"]
    assert pooled["Effusion"]["sites_labelling"] == ["site-a"] and pooled["Nodule"]["sites_labelling"] == ["site-b"]
    best = out / BEST_MODEL
    for c in ("Mass", "Effusion", "Nodule"):
        assert abs(pooled[c]["auroc"]["value"] - central_auroc(datas, best, c)) <= 0.002, c


# --------------------------------------------------------------- early stopping, best cycle
def test_early_stop_after_patience_cycles_keeps_the_best_not_the_latest(datas, tmp_path):
    log: list = []
    out = tmp_path / "out"
    # cycle 3 improves by less than min_delta: no improvement; cycle 4 neither: stop after cycle 4
    losses = {1: 0.9, 2: 0.7, 3: 0.68, 4: 0.69, 5: 0.1}
    result = run(
        datas, config(num_cycles=5, patience=2, min_delta=0.05), out, wrap=chain(scripted(losses), recorder(log))
    )
    assert [h["cycle"] for h in result.history] == [1, 2, 3, 4]
    assert result.stopped_early and result.best_cycle == 2 and result.best_val_loss == 0.7
    cycle2 = [returned for c, _, _, returned in log if c == 2][-1]
    assert same({k: v.numpy() for k, v in result.model.state_dict().items()}, weights(cycle2))
    assert (
        ckpt_equals(out / "best_FL_global_model.pt", cycle2)
        and load_checkpoint(out / "best_FL_global_model.pt")["cycle"] == 2
    )
    assert ckpt_equals(out / "FL_global_model.pt", log[-1][3]) and not ckpt_equals(out / "FL_global_model.pt", cycle2)
    assert [c["best_cycle"] for c in records(out, "cycles.jsonl")] == [1, 2, 2, 2]


def test_the_untrained_model_is_never_the_best(datas, tmp_path):
    out = tmp_path / "out"
    result = run(datas, config(num_cycles=2, patience=5), out, wrap=scripted({1: math.nan, 2: math.nan}))
    assert result.best_cycle == 2 and math.isnan(result.best_val_loss)  # no finite loss: the last cycle's model
    assert load_checkpoint(out / "best_FL_global_model.pt")["cycle"] == 2
    assert not result.stopped_early


# ---------------------------------------------------------------- too few sites: retry, stop
def test_a_cycle_with_too_few_trained_sites_is_run_again_from_its_start(datas, tmp_path):
    out = tmp_path / "out"
    attempts = {"n": 0}

    def flaky(name, host):  # site-b is down at its first cycle-2 turn only
        def when(task, meta):
            if name == "site-b" and task == "train" and meta["cycle"] == 2:
                attempts["n"] += 1
                return attempts["n"] == 1
            return False

        return Failing(host, when)

    relay = RelayConfig(min_sites=2, min_sites_timeout=60, retry_pause=0, evaluate_test=False)
    result = run(datas, config(num_cycles=2), out, wrap=flaky, relay=relay)
    cycles = records(out, "cycles.jsonl")
    assert [(c["cycle"], c["status"], c["attempt"]) for c in cycles] == [
        (1, "completed", 1),
        (2, "too_few_sites", 1),
        (2, "completed", 2),
    ]
    assert cycles[1]["trained"] == ["site-a"] and "site-b" in cycles[1]["skipped"]
    visits = [v for v in records(out, "visits.jsonl") if v["cycle"] == 2]
    assert [(v["attempt"], v["site"], v["status"]) for v in visits] == [
        (1, "site-a", "trained"),
        (1, "site-b", "skipped"),
        (2, "site-a", "trained"),
        (2, "site-b", "trained"),
    ]
    assert visits[2]["sent_digest"] == visits[0]["sent_digest"]  # the second attempt starts from cycle 1's model
    assert visits[2]["iteration"] == visits[0]["iteration"] == 2  # and from its learning-rate schedule position
    assert result.cycles_run == 2 and [h["cycle"] for h in result.history] == [1, 2]


def test_too_few_sites_until_the_timeout_stops_the_run_with_the_reason(datas, tmp_path):
    out = tmp_path / "out"
    relay = RelayConfig(min_sites=2, min_sites_timeout=0, retry_pause=0, evaluate_test=False)
    with pytest.raises(RunStopped) as stop:
        run(datas, config(num_cycles=3), out, wrap=down("site-b", {2}), relay=relay, run_id="job-7")
    reason = str(stop.value)
    assert "cycle 2: only 1 site(s) trained (min_sites=2" in reason and "site-b" in reason
    assert "resume_from='job-7'" in reason
    cycles = records(out, "cycles.jsonl")
    assert [(c["cycle"], c["status"]) for c in cycles] == [(1, "completed"), (2, "too_few_sites"), (2, "stopped")]
    assert cycles[-1]["reason"] == reason
    assert load_checkpoint(out / "FL_global_model.pt")["cycle"] == 1  # the last completed cycle, never a partial one
    assert (out / "cxrfl_resume" / "job-7" / "state.pt").is_file()
    assert not (out / "cxrfl" / "evaluation.json").exists()


def test_the_relay_does_not_start_without_min_sites(datas, tmp_path):
    relay = RelayConfig(min_sites=2, min_sites_timeout=0, retry_pause=0)

    def wrap(name, host):
        return Failing(host, lambda task, meta: name == "site-a" and task == "counts") if name == "site-a" else host

    with pytest.raises(RunStopped, match=r"only 1 site\(s\) can take part \(min_sites=2\)"):
        run(datas, config(), tmp_path / "out", wrap=wrap, relay=relay)


# --------------------------------------------------------------------------------- resume
def test_a_resumed_run_goes_on_from_the_saved_weights_to_the_same_end(datas, tmp_path):
    cfg = config(num_cycles=3)
    first = tmp_path / "first"
    with pytest.raises(Crash):  # the server dies during cycle 2, at site-b's turn
        run(datas, cfg, first, wrap=down("site-b", {2}, error=Crash), run_id="job-1")
    folder = first / "cxrfl_resume" / "job-1"
    raw = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
    # issue 43: the state pickled the model and the best model again; it now names the checkpoints, linked
    assert "weights" not in raw and "best_weights" not in raw
    assert os.path.samefile(folder / raw["models"]["weights"], first / "FL_global_model.pt")
    assert os.path.samefile(folder / raw["models"]["best_weights"], first / "best_FL_global_model.pt")
    saved = ResumeStore.read(folder / "state.pt")
    assert saved["cycle"] == 1
    assert ckpt_equals(first / "FL_global_model.pt", saved["weights"])  # the last saved model is cycle 1's

    log: list = []
    second = tmp_path / "second"
    resumed = run(
        datas, cfg, second, wrap=recorder(log), run_id="job-2", resume_root=first / "cxrfl_resume", resume_from="job-1"
    )
    assert log[0][:2] == (2, "site-a") and same(log[0][2], {**saved["weights"], **saved["optimizer"]})  # tensors
    cycles = records(second, "cycles.jsonl")
    assert [(c["cycle"], c["status"]) for c in cycles] == [(1, "resumed"), (2, "completed"), (3, "completed")]
    assert {v["cycle"] for v in records(second, "visits.jsonl")} == {2, 3}  # no completed cycle redone
    assert [h["cycle"] for h in resumed.history] == [1, 2, 3]
    assert load_checkpoint(second / "FL_global_model.pt")["cycle"] == 3
    assert not (second / "cxrfl_resume" / "job-2").exists()

    whole = run(datas, cfg, tmp_path / "whole")  # the same run without interruption
    assert whole.cycles_run == resumed.cycles_run == 3
    assert same(
        load_checkpoint(tmp_path / "whole" / "FL_global_model.pt")["model"],
        load_checkpoint(second / "FL_global_model.pt")["model"],
    )


def test_resume_refuses_other_settings_or_a_missing_state(datas, tmp_path):
    cfg = config(num_cycles=2)
    first = tmp_path / "first"
    with pytest.raises(Crash):
        run(datas, cfg, first, wrap=down("site-a", {1}, error=Crash))
    root = first / "cxrfl_resume"
    with pytest.raises(RunStopped, match=r"other settings for \['cwt_config'\]"):
        run(datas, config(num_cycles=2, lr=5e-4), tmp_path / "second", resume_root=root, resume_from="run")
    with pytest.raises(RunStopped, match=r"does not exist"):
        run(datas, cfg, tmp_path / "third", resume_root=root, resume_from="nowhere")


# ---------------------------------------------------------------------------------- abort
def test_abort_writes_nothing_further_and_leaves_a_readable_model(datas, tmp_path):
    out = tmp_path / "out"
    flag = {"abort": False}

    def trip(name, host):  # the operator aborts while site-b trains in cycle 2
        def when(task, meta):
            if name == "site-b" and task == "train" and meta["cycle"] == 2:
                flag["abort"] = True
            return False

        return Failing(host, when)

    with pytest.raises(RunAborted):
        run(datas, config(num_cycles=3), out, wrap=trip, aborted=lambda: flag["abort"])
    assert [(v["cycle"], v["site"]) for v in records(out, "visits.jsonl")] == [
        (1, "site-a"),
        (1, "site-b"),
        (2, "site-a"),
    ]
    assert [c["cycle"] for c in records(out, "cycles.jsonl")] == [1]
    assert not (out / "cxrfl" / "evaluation.json").exists()
    model, classes, _ = model_from_checkpoint(out / "FL_global_model.pt")  # what cxrfl predict reads
    assert classes == [BINARY_CLASS] and load_checkpoint(out / "FL_global_model.pt")["cycle"] == 1


# ---------------------------------------------------------------- the paper's base recipe
def test_the_server_carries_the_iteration_count_and_the_weight_decay_across_visits(datas, tmp_path):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    out = tmp_path / "out"
    cfg = config(num_cycles=2, local_steps=2, lr=1e-2, lr_decay=0.5, lr_decay_every=3, weight_decay=3e-3)
    seen = []
    handle = register_optimizer_step_pre_hook(
        lambda opt, *_: seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]))
    )
    try:
        run(datas, cfg, out)
    finally:
        handle.remove()
    # 4 visits of 2 steps: iterations 0..7 across sites and cycles, rate 1e-2 * 0.5 ** (t // 3)
    assert [lr for lr, _ in seen] == pytest.approx([1e-2 * 0.5 ** (t // 3) for t in range(8)])
    assert {wd for _, wd in seen} == {3e-3}
    assert [v["iteration"] for v in records(out, "visits.jsonl")] == [0, 2, 4, 6]


# ------------------------------------------------------------------------------ site host
def test_the_site_host_answers_each_task_from_its_own_data(datas):
    from cxrfl.common.io import to_numpy
    from cxrfl.cwt.host import CWTSiteHost
    from cxrfl.nn.models import build_model

    host = CWTSiteHost(datas[0], warning=lambda m: None)
    cfg = config(task="multilabel", lwms=True)
    meta = {"cwt_config": cfg.to_dict(), "model_config": MODEL.to_dict(), "classes": None}
    _, counts = host.handle("counts", {}, meta)
    assert counts == {"counts": {"n_train": 6, "n_val": 2, "classes": ["Effusion", "Mass"]}}
    assert host.describe("counts", meta, counts) == "site site-a: sending counts " + str(counts["counts"])
    classes = ["Effusion", "Mass", "Nodule"]
    torch.manual_seed(0)
    sent = to_numpy(build_model(MODEL, 3).state_dict())
    visit = {**meta, "classes": classes, "cycle": 2, "position": 1, "steps": 1, "lr": 1e-3, "iteration": 5}
    params, answer = host.handle("train", sent, visit)
    m = answer["metrics"]
    assert m["steps"] == 1 and m["iteration"] == 5 and m["received_digest"] == params_digest(sent)
    assert m["returned_digest"] == params_digest(weights(params)) != m["received_digest"]
    assert host.site.classes == classes  # rebuilt for the union head
    assert host.describe("train", visit, answer).startswith(
        "site site-a cycle 2 visit 2: 1 steps at lr 0.001 (iteration 5)"
    )
    assert host.scalars("train", answer) == ({"train_loss": m["train_loss"], "lr": 1e-3}, 2)
    _, val = host.handle("validate", params, {**meta, "classes": classes, "split": "val", "cycle": 2})
    assert val["metrics"]["split"] == "val" and val["metrics"]["n_known"] == 4  # 2 images x 2 annotated classes
    assert host.describe("validate", {}, val).startswith("site site-a val: loss ")
    assert host.scalars("validate", val)[1] == 2 and host.scalars("counts", counts) is None
    with pytest.raises(ValueError, match="unknown task"):
        host.handle("aggregate", {}, meta)


def test_a_host_built_on_a_site_refuses_other_settings(datas):
    from cxrfl.cwt.host import CWTSiteHost
    from cxrfl.errors import ConfigError

    cfg = config()
    site = make_sites(datas, cfg, MODEL)[0]
    host = CWTSiteHost(site=site)
    other = {"cwt_config": config(cwl=True).to_dict(), "model_config": MODEL.to_dict(), "classes": [BINARY_CLASS]}
    host.handle("counts", {}, other)
    assert host.site is site and site.config.cwl  # only the optimizations changed: reconfigured in place
    with pytest.raises(ConfigError, match="site site-a: built for other settings"):
        host.handle("counts", {}, {**other, "cwt_config": config(task="multilabel").to_dict()})
