"""FedFew's server workflow over a scripted transport: weighted FedAvg, margins, threshold, stage 2's
early stopping on the CC validation loss (best model kept), retries of rounds with too few valid
results and the stop with its reason, malformed results rejected one line each, resume from an
interrupted run (per stage and within a stage), the old ``resume`` alias, the site's log lines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from cxrfl.common.server import RunAborted, RunStopped
from cxrfl.errors import ConfigError
from cxrfl.fedfew import protocol as P
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.energy import threshold_counts
from cxrfl.fedfew.prototypes import DualPrototype
from cxrfl.fedfew.server import FedFewServer
from cxrfl.fedfew.stages import STAGE_FILES
from cxrfl.nn.models import ModelConfig, load_checkpoint

CC, UC = "Atelectasis", "Hernia"
W = "backbone.conv0.weight"
MODEL = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here


def _info(classes, pos, neg, n_labelled=100, n_ssl=120):
    return {
        "classes": classes,
        "n_labelled": n_labelled,
        "n_ssl": n_ssl,
        "positives": dict(zip(classes, pos)),
        "negatives": dict(zip(classes, neg)),
    }


def _shift(params, delta):
    return {k: (v + delta).astype(v.dtype) if np.issubdtype(v.dtype, np.floating) else v for k, v in params.items()}


class ScriptedSites:
    """Three sites answering every FedFew task with hand-chosen numbers; records what they received.

    cc-1 (10 labelled images) and cc-2 (30) label the CC, uc-1 (20) the UC. A training round
    returns the weights received + 1 (cc-1), + 3 (cc-2), + 5 (uc-1). Energies: each CC site's
    CC images sum to -30 over 10; the UC site's in examples at -5 and -4, its out examples at -1
    and 0. A validation pass on ``val`` returns the next of ``val_losses`` (over 10 known labels
    per CC site; no loss when the list is empty). ``fail``: (task, site) -> how many of its next
    tasks fail (no answer); ``corrupt``: (task, site) -> a function applied to its next answer.
    """

    SHIFT = {"cc-1": 1.0, "cc-2": 3.0, "uc-1": 5.0}
    SAMPLES = {"cc-1": 10, "cc-2": 30, "uc-1": 20}

    def __init__(self, val_losses=(), fail=None, corrupt=None):
        self.sent: list[tuple[str, str, dict, dict]] = []
        self.val_losses = list(val_losses)
        self.val_calls = {"cc-1": 0, "cc-2": 0}
        self.fail = dict(fail or {})
        self.corrupt = dict(corrupt or {})
        self.streamed: list[tuple[str, bool]] = []  # (task, whether the server took each answer as it came)

    def __call__(self, task, payloads, *, on_answer=None):  # a Send (common/transport.py), streaming too
        self.streamed.append((task, on_answer is not None))
        out = {}
        for site, (params, meta) in payloads.items():
            self.sent.append((task, site, params, meta))
            if self.fail.get((task, site), 0) > 0:
                self.fail[(task, site)] -= 1
                continue
            answer = self.answer(task, site, params, meta)
            fix = self.corrupt.pop((task, site), None)
            out[site] = fix(*answer) if fix else answer
            if on_answer is not None:
                on_answer(site, out[site])
                out[site] = ({}, out[site][1])
        return out

    def answer(self, task, site, params, meta):
        uc_site = site == "uc-1"
        if task == P.INFO:
            return {}, {"info": _info([UC], [12], [120]) if uc_site else _info([CC], [40], [60])}
        if task in (P.SSL, P.TRAIN):
            return _shift(params, self.SHIFT[site]), {
                "num_samples": self.SAMPLES[site],
                "metrics": {"round": meta["round"]},
            }
        if task == P.ENERGY:
            e_in, e_out = ([-5.0, -4.0], [-1.0, 0.0]) if uc_site else ([], [])
            if meta["mode"] == "means":
                cc_in = (0.0, 0) if uc_site else (-30.0, 10)  # the UC site labels no CC
                return {}, {"stats": {"sum_in": cc_in[0], "n_in": cc_in[1], "sum_out": sum(e_out), "n_out": len(e_out)}}
            if meta["mode"] == "range":
                both = e_in + e_out
                return {}, {
                    "stats": {
                        "min": min(both) if both else None,
                        "max": max(both) if both else None,
                        "n_in": len(e_in),
                        "n_out": len(e_out),
                    }
                }
            return {}, {"stats": threshold_counts(e_in, e_out, meta["grid"])}
        if task == P.DETECTORS:
            return {}, {"prototypes": [DualPrototype(UC, np.ones(4), np.zeros(4), 12, 120).to_payload()], "refused": {}}
        if meta.get("split") == "val":
            k = self.val_calls[site]
            self.val_calls[site] += 1
            loss = self.val_losses[k] if k < len(self.val_losses) else None
            return {}, {"metrics": {"split": "val", "cc_loss": loss, "cc_known": 10}}
        return {}, {"metrics": {"split": "test", "cc_mean_auroc": 0.75}}

    def first(self, task):
        return next(params for t, _, params, _ in self.sent if t == task)

    def params_of(self, task):
        return [(site, params, meta) for t, site, params, meta in self.sent if t == task]


SMALL = FedFewConfig(ssl_rounds=1, warmup_rounds=1, rounds=1, ssl_proj_dim=64, ssl_pred_dim=16, threshold_bins=8)


def _server(tmp_path, send, config=SMALL, model_config=MODEL, **kw):
    msgs = []
    kw.setdefault("out_dir", tmp_path)
    kw.setdefault("min_clients_timeout", 0)
    kw.setdefault("retry_pause", 0)
    server = FedFewServer(
        send,
        sites=["cc-1", "cc-2", "uc-1"],
        config=config,
        model_config=model_config,
        info=msgs.append,
        warning=msgs.append,
        **kw,
    )
    return server, msgs


def _tensors(params):
    return {k: torch.as_tensor(np.asarray(v)) for k, v in params.items()}


def _equal(a, b):
    a, b = _tensors(a), _tensors(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _records(app: Path):
    return [json.loads(line) for line in (app / "cxrfl" / "rounds.jsonl").read_text().splitlines()]


def test_workflow_averages_by_images_and_keeps_what_it_decides(tmp_path):
    sites = ScriptedSites()
    server, msgs = _server(tmp_path / "app", sites, resume_root=tmp_path / "resume", run_id="job-1")
    outcome = server.run()
    app = tmp_path / "app"
    recs = _records(app)
    assert [(r["stage"], r.get("phase")) for r in recs] == [(1, "ssl"), (2, "warm-up"), (2, "energy"), (3, None)]
    # stage 1: every site, weighted by images: + (1*10 + 3*30 + 5*20) / 60 = + 10/3
    ssl_sent = sites.first(P.SSL)
    stage1 = torch.load(app / "fedfew" / "stage1_ssl.pt", weights_only=True)["ssl_state"]
    assert torch.allclose(stage1[W], torch.as_tensor(ssl_sent[W]) + 10 / 3, atol=1e-5)
    # stage 2 warm-up: CC sites only (the UC site has no loss without lambda): + (1*10 + 3*30) / 40 = + 2.5
    trains = [(site, params) for site, params, _ in sites.params_of(P.TRAIN)]
    assert [s for s, _ in trains] == ["cc-1", "cc-2", "cc-1", "cc-2", "uc-1"]
    assert torch.allclose(torch.as_tensor(trains[2][1][W]), torch.as_tensor(trains[0][1][W]) + 2.5, atol=1e-5)
    assert torch.equal(torch.as_tensor(trains[0][1][W]), stage1[W])  # the stage-2 encoder starts from stage 1's
    # margins from the warm-up means: CC images -60/20 = -3, UC images (-1 + 0)/2 = -0.5, widened by 1
    assert outcome.margins["m_in"] == pytest.approx(-4.0) and outcome.margins["m_out"] == pytest.approx(0.5)
    # threshold: in {-5, -4}, out {-1, 0} on the grid over [-5, 0]: every choice between -4 and -1 is perfect
    assert -4.0 < outcome.threshold < -1.0 and outcome.threshold_stats["errors"] == 0
    (proto,) = outcome.detectors[UC]
    assert proto.n_positive == 12 and proto.positive.tolist() == [1.0] * 4
    # no validation loss reported: the last aggregate is kept, with a warning
    assert any("no round could be scored" in m for m in msgs)
    final = load_checkpoint(outcome.final_path)
    assert _equal(final["model"], outcome.model_state)
    assert "site" not in final["fedfew"]["prototypes"][UC][0]  # prototypes carry no site name
    assert json.loads((app / "cxrfl" / "evaluation.json").read_text())["sites"]["cc-1"]["cc_mean_auroc"] == 0.75
    assert json.loads((app / "cxrfl" / "run_config.json").read_text())["run_id"] == "job-1"
    assert not (tmp_path / "resume" / "job-1").exists()  # finished: nothing to resume


def test_stage2_stops_early_on_the_cc_validation_loss_and_keeps_the_best_rounds(tmp_path):
    # warm-up rounds 1-3 score 0.9, 0.8, 0.85 (best: 2); energy rounds 4-... 0.7, 0.6, 0.65, 0.66: patience 2
    # ends them after round 7 (rounds 6, 7 without improvement; the maximum of 6 energy rounds is not reached)
    cfg = SMALL.replace(warmup_rounds=3, rounds=6, patience=2)
    sites = ScriptedSites(val_losses=[0.9, 0.8, 0.85, 0.7, 0.6, 0.65, 0.66])
    server, msgs = _server(tmp_path, sites, config=cfg)
    outcome = server.run()
    recs = [r for r in _records(tmp_path) if r["stage"] == 2]
    assert [(r["round"], r["phase"], r["val_loss"]) for r in recs] == [
        (1, "warm-up", 0.9),
        (2, "warm-up", 0.8),
        (3, "warm-up", 0.85),
        (4, "energy", 0.7),
        (5, "energy", 0.6),
        (6, "energy", 0.65),
        (7, "energy", 0.66),
    ]
    start = torch.as_tensor(sites.first(P.TRAIN)[W])
    warmup_best = start + 2 * 2.5  # round 2: two warm-up averages of + 2.5
    energy_sent = [p for s, p, m in sites.params_of(P.TRAIN) if m["energy_weight"] > 0]
    assert torch.allclose(torch.as_tensor(energy_sent[0][W]), warmup_best, atol=1e-5)  # the warm-up's best starts them
    means = [p for _, p, m in sites.params_of(P.ENERGY) if m["mode"] == "means"]
    assert torch.allclose(torch.as_tensor(means[0][W]), warmup_best, atol=1e-5)  # ... and chooses the margins
    # stage 2's result is round 5: the warm-up's best + two energy averages of + 10/3
    assert torch.allclose(torch.as_tensor(outcome.model_state[W]), warmup_best + 20 / 3, atol=1e-4)
    assert _equal(load_checkpoint(tmp_path / "fedfew" / "stage2_model.pt")["model"], outcome.model_state)
    assert any("stage 2 energy: early stop after 2 round(s)" in m and "keeping round 5" in m for m in msgs)
    # the validation pass goes to the CC sites only, on their validation split
    vals = [(s, m["split"]) for s, _, m in sites.params_of(P.VALIDATE)]
    assert vals[:2] == [("cc-1", "val"), ("cc-2", "val")] and ("uc-1", "val") not in vals


def test_without_lambda_stage2_keeps_fedfews_schedule_with_bce_rounds_at_the_cc_sites(tmp_path):
    # the same scores as above: the warm-up stops after round 3 (best 2); the BCE rounds 4-7 follow
    # with their own patience, as the energy rounds would, so the ablation trains as long as FedFew
    cfg = SMALL.replace(warmup_rounds=3, rounds=6, patience=2, energy_weight=0.0)
    sites = ScriptedSites(val_losses=[0.9, 0.8, 0.85, 0.7, 0.6, 0.65, 0.66])
    server, _ = _server(tmp_path, sites, config=cfg)
    outcome = server.run()
    recs = [r for r in _records(tmp_path) if r["stage"] == 2]
    assert [(r["round"], r["phase"]) for r in recs] == [(1, "warm-up"), (2, "warm-up"), (3, "warm-up")] + [
        (r, "bce") for r in (4, 5, 6, 7)
    ]
    trains = sites.params_of(P.TRAIN)
    assert {s for s, _, _ in trains} == {"cc-1", "cc-2"}  # the UC site has no loss without lambda
    assert all(m["energy_weight"] == 0 for _, _, m in trains)
    assert not [m for _, _, m in sites.params_of(P.ENERGY) if m["mode"] == "means"]  # no margins to choose
    start = torch.as_tensor(sites.first(P.TRAIN)[W])
    warmup_best = start + 2 * 2.5
    assert torch.allclose(torch.as_tensor(trains[6][1][W]), warmup_best, atol=1e-5)  # round 4 starts from it
    # the result is round 5: the warm-up's best + two CC-only averages of + 2.5
    assert torch.allclose(torch.as_tensor(outcome.model_state[W]), warmup_best + 5.0, atol=1e-4)
    assert outcome.margins["chosen"].startswith("unused")


def test_a_round_with_too_few_valid_results_is_run_again_with_the_same_weights(tmp_path):
    sites = ScriptedSites(fail={(P.TRAIN, "cc-1"): 1})  # the warm-up round's first attempt: cc-2 only
    server, msgs = _server(tmp_path, sites, min_clients=2, min_clients_timeout=60)
    server.run()
    recs = [r for r in _records(tmp_path) if r["stage"] == 2]
    assert [(r["round"], r.get("status")) for r in recs] == [(1, "too_few_results"), (1, None), (2, None)]
    assert recs[0]["sites_answered"] == ["cc-2"] and recs[0]["sites_aggregated"] == []
    first, again = [p for s, p, _ in sites.params_of(P.TRAIN) if s == "cc-2"][:2]
    assert _equal(first, again)  # nothing of the failed attempt was kept
    assert any(
        "stage 2 round 1 had fewer than 2 valid results (min_clients=2; answered ['cc-2']" in m
        and "running it again in 0s" in m
        for m in msgs
    )


def test_a_round_that_never_gets_enough_results_stops_the_run_with_one_line(tmp_path):
    sites = ScriptedSites(fail={(P.TRAIN, "cc-1"): 10**6})
    server, _ = _server(tmp_path / "app", sites, min_clients=2, resume_root=tmp_path / "resume", run_id="job-1")
    with pytest.raises(RunStopped) as err:
        server.run()
    reason = str(err.value)
    assert "\n" not in reason
    assert reason.startswith("stopping: stage 2 round 1 had fewer than 2 valid results")
    assert "answered ['cc-2'], no answer from ['cc-1']" in reason and "resume_from='job-1'" in reason
    assert _records(tmp_path / "app")[-1] == {
        "stage": 2,
        "round": 1,
        "phase": "warm-up",
        "status": "stopped",
        "reason": reason,
    }
    assert (tmp_path / "resume" / "job-1" / STAGE_FILES[1]).is_file()  # the finished stage is kept


def test_min_clients_above_a_phases_sites_asks_for_all_of_them(tmp_path):
    # min_clients 3: stage 1 and the energy rounds need all three sites, the warm-up its two CC sites
    sites = ScriptedSites(fail={(P.SSL, "uc-1"): 1, (P.TRAIN, "cc-2"): 1})
    server, msgs = _server(tmp_path, sites, min_clients=3, min_clients_timeout=60)
    server.run()
    recs = [(r["stage"], r.get("round"), r.get("status")) for r in _records(tmp_path)]
    assert recs == [
        (1, 1, "too_few_results"),
        (1, 1, None),
        (2, 1, "too_few_results"),
        (2, 1, None),
        (2, 2, None),
        (3, None, None),
    ]
    assert any("stage 2 round 1 had fewer than 2 valid results (min_clients=3;" in m for m in msgs)


def test_no_info_answer_is_asked_again_then_stops_with_the_reason(tmp_path):
    server, msgs = _server(tmp_path, lambda task, payloads: {})
    with pytest.raises(RunStopped, match="stopping: no site answered the info task"):
        server.run()
    assert any("site cc-1 gave no result" in m for m in msgs)
    sites = ScriptedSites(fail={(P.INFO, s): 1 for s in ("cc-1", "cc-2", "uc-1")})
    server, msgs = _server(tmp_path / "again", sites, min_clients_timeout=60)
    server.run()
    assert sum(1 for t, *_ in sites.sent if t == P.INFO) == 6
    assert any("no site answered the info task at the start (min_clients=1); running it again" in m for m in msgs)


def _nan(params, meta):
    bad = dict(params)
    bad[W] = np.full_like(params[W], np.nan)
    return bad, meta


def _short(params, meta):
    return {**params, W: params[W][:-1]}, meta


def _no_count(params, meta):
    return params, {**meta, "num_samples": 0}


def test_malformed_results_are_rejected_one_line_each_and_the_valid_ones_averaged(tmp_path):
    sites = ScriptedSites(corrupt={(P.SSL, "cc-1"): _nan, (P.SSL, "uc-1"): _short, (P.TRAIN, "cc-2"): _no_count})
    server, msgs = _server(tmp_path, sites)
    server.run()
    recs = _records(tmp_path)
    ssl = recs[0]
    assert ssl["sites_aggregated"] == ["cc-2"] and set(ssl["rejected"]) == {"cc-1", "uc-1"}
    assert "non-finite" in ssl["rejected"]["cc-1"] and "shape" in ssl["rejected"]["uc-1"]
    stage1 = torch.load(tmp_path / "fedfew" / "stage1_ssl.pt", weights_only=True)["ssl_state"]
    assert torch.allclose(stage1[W], torch.as_tensor(sites.first(P.SSL)[W]) + 3.0)  # cc-2's update alone
    lines = [m for m in msgs if m.startswith("rejected the update of site")]
    assert len(lines) == 3 and all("\n" not in m for m in lines)
    assert "num_samples" in recs[1]["rejected"]["cc-2"] and recs[1]["sites_aggregated"] == ["cc-1"]


def _scaled(params, meta):  # cc-1's change (+1) made 100x larger
    return _shift(params, 99.0), meta


def test_each_update_norm_is_recorded_and_a_scaled_site_is_named_in_a_warning(tmp_path):
    # issue 40 point 3 for FedFew: a scaled update is averaged in without a robust option; the round record
    # keeps each site's update norm (the L2 change from the weights it was sent) and a warning names the site
    sites = ScriptedSites(corrupt={(P.SSL, "cc-1"): _scaled})
    server, msgs = _server(tmp_path, sites)
    server.run()
    sent = sites.first(P.SSL)
    root = np.sqrt(sum(v.size for v in sent.values() if np.issubdtype(v.dtype, np.floating)))
    ssl, train = _records(tmp_path)[:2]
    assert ssl["update_norm"] == pytest.approx({"cc-1": 100 * root, "cc-2": 3 * root, "uc-1": 5 * root})
    assert ssl["unchanged_share"] == {"cc-1": 0.0, "cc-2": 0.0, "uc-1": 0.0}
    assert set(train["update_norm"]) == set(train["sites_aggregated"])  # every round of every stage records it
    lines = [m for m in msgs if "update norm" in m]
    assert lines == [
        f"stage 1 round 1: site cc-1: its update norm {100 * root:.4g} is 20x the round's median ({5 * root:.4g}); "
        "a scaled or broken update: check that site (robust: median or clip bounds it)"
    ]


def _abort_after(app: Path, stage: int, rnd: int | None = None):
    """Abort once ``stage`` finished (``rnd`` None) or its round ``rnd`` is recorded."""

    def aborted():
        if rnd is None:
            return (app / "fedfew" / STAGE_FILES[stage]).is_file()
        path = app / "cxrfl" / "rounds.jsonl"
        return path.is_file() and any(
            r["stage"] == stage and r.get("round") == rnd and "status" not in r for r in _records(app)
        )

    return aborted


def test_an_interrupted_run_resumes_from_its_last_finished_stage(tmp_path):
    first, _ = _server(
        tmp_path / "app1",
        ScriptedSites(),
        resume_root=tmp_path / "resume",
        run_id="job-1",
        aborted=_abort_after(tmp_path / "app1", 2),
    )
    with pytest.raises(RunAborted):
        first.run()
    kept = tmp_path / "resume" / "job-1"
    assert {"stage1_ssl.pt", "stage2_model.pt"} <= {p.name for p in kept.iterdir()}
    interrupted = load_checkpoint(kept / "stage2_model.pt")["model"]

    sites = ScriptedSites()
    second, msgs = _server(
        tmp_path / "app2", sites, resume_root=tmp_path / "resume", run_id="job-2", resume_from="job-1"
    )
    outcome = second.run()
    assert {t for t, *_ in sites.sent} == {P.INFO, P.ENERGY, P.DETECTORS, P.VALIDATE}  # no stage 1 or 2 task
    assert _equal(sites.first(P.ENERGY), interrupted)  # the resumed run starts from the saved weights
    assert _equal(load_checkpoint(outcome.final_path)["model"], interrupted)
    assert [r["stage"] for r in _records(tmp_path / "app2")] == [3] and outcome.skipped_stages == [1, 2]
    assert (tmp_path / "app2" / "fedfew" / "stage2_model.pt").read_bytes() == (kept / "stage2_model.pt").read_bytes()
    assert any("resume: stage(s) 1-2 loaded" in m for m in msgs)
    assert not (tmp_path / "resume" / "job-2").exists()


def test_a_run_killed_mid_stage_goes_on_after_its_last_completed_round(tmp_path):
    cfg = SMALL.replace(ssl_rounds=2, warmup_rounds=2, rounds=3, patience=5)
    losses = [0.9, 0.8, 0.7, 0.75, 0.72]
    whole, _ = _server(tmp_path / "whole", ScriptedSites(val_losses=losses), config=cfg)
    uninterrupted = whole.run()

    first, _ = _server(
        tmp_path / "app1",
        ScriptedSites(val_losses=losses),
        config=cfg,
        resume_root=tmp_path / "resume",
        run_id="job-1",
        aborted=_abort_after(tmp_path / "app1", 2, 3),
    )
    with pytest.raises(RunAborted):
        first.run()
    saved = torch.load(tmp_path / "resume" / "job-1" / "state.pt", weights_only=True)
    assert (saved["stage"], saved["round"], saved["phase"]) == (2, 3, 1)

    sites = ScriptedSites(val_losses=losses[3:])
    second, msgs = _server(
        tmp_path / "app2", sites, config=cfg, resume_root=tmp_path / "resume", run_id="job-2", resume_from="job-1"
    )
    outcome = second.run()
    assert P.SSL not in {t for t, *_ in sites.sent}  # stage 1 is not redone
    assert _equal(sites.first(P.TRAIN), saved["params"])  # the first weights sent are the saved ones
    assert [(r["stage"], r.get("round")) for r in _records(tmp_path / "app2")] == [(2, 4), (2, 5), (3, None)]
    assert any("resume: stage 2 goes on after its round 3" in m for m in msgs)
    # the same rounds, the same result as the uninterrupted run (best round 3 of the energy phase)
    assert _equal(outcome.model_state, uninterrupted.model_state)
    assert outcome.margins == uninterrupted.margins


def test_progress_of_other_settings_is_not_resumed(tmp_path):
    cfg = SMALL.replace(warmup_rounds=2, rounds=2)
    first, _ = _server(
        tmp_path / "app1",
        ScriptedSites(),
        config=cfg,
        resume_root=tmp_path / "resume",
        run_id="job-1",
        aborted=_abort_after(tmp_path / "app1", 2, 1),
    )
    with pytest.raises(RunAborted):
        first.run()
    sites = ScriptedSites()
    second, msgs = _server(
        tmp_path / "app2",
        sites,
        config=cfg.replace(lr=0.01),
        resume_root=tmp_path / "resume",
        run_id="job-2",
        resume_from="job-1",
    )
    second.run()
    assert any("with other settings (['fedfew_config']); stage 2 starts over" in m for m in msgs)
    assert [r["round"] for r in _records(tmp_path / "app2") if r["stage"] == 2] == [1, 2, 3, 4]


def test_a_resumed_run_that_is_interrupted_again_can_be_resumed_in_turn(tmp_path):
    first, _ = _server(
        tmp_path / "app1",
        ScriptedSites(),
        resume_root=tmp_path / "resume",
        run_id="job-1",
        aborted=_abort_after(tmp_path / "app1", 1),
    )
    with pytest.raises(RunAborted):
        first.run()
    second, _ = _server(
        tmp_path / "app2",
        ScriptedSites(),
        resume_root=tmp_path / "resume",
        run_id="job-2",
        resume_from="job-1",
        aborted=_abort_after(tmp_path / "app2", 2),
    )
    with pytest.raises(RunAborted):
        second.run()
    assert {"stage1_ssl.pt", "stage2_model.pt"} <= {p.name for p in (tmp_path / "resume" / "job-2").iterdir()}
    sites = ScriptedSites()
    third, _ = _server(tmp_path / "app3", sites, resume_root=tmp_path / "resume", run_id="job-3", resume_from="job-2")
    third.run()
    assert P.SSL not in {t for t, *_ in sites.sent} and P.TRAIN not in {t for t, *_ in sites.sent}


def test_resume_refuses_other_model_settings(tmp_path):
    first, _ = _server(
        tmp_path / "app1",
        ScriptedSites(),
        resume_root=tmp_path / "resume",
        run_id="job-1",
        aborted=_abort_after(tmp_path / "app1", 2),
    )
    with pytest.raises(RunAborted):
        first.run()
    other, _ = _server(
        tmp_path / "app2",
        ScriptedSites(),
        model_config=MODEL.replace(dropout=0.2),
        resume_root=tmp_path / "resume",
        run_id="job-2",
        resume_from="job-1",
    )
    with pytest.raises(RunStopped, match="stage2_model.pt was trained with model settings .*remove resume_from"):
        other.run()


def test_round_hook_sees_the_initial_and_every_aggregated_model(tmp_path):
    seen = []
    sites = ScriptedSites()
    server, _ = _server(
        tmp_path,
        sites,
        config=SMALL.replace(ssl_rounds=2),
        on_round=lambda stage, rnd, params: seen.append((stage, rnd, params[W].copy())),
    )
    server.run()
    assert [(s, r) for s, r, _ in seen] == [(1, 0), (1, 1), (1, 2), (2, 1), (2, 2)]
    assert np.array_equal(seen[0][2], sites.first(P.SSL)[W]) and np.allclose(seen[1][2], seen[0][2] + 10 / 3)


def test_every_weight_round_streams_its_answers_into_the_average(tmp_path):
    # issue 43 point 1: FedFew collected every site's weights and then averaged them; each answer of a stage-1 or
    # stage-2 round now goes into the running sum as it arrives (the transport keeps only its meta)
    sites = ScriptedSites()
    server, _ = _server(tmp_path, sites)
    server.run()
    weight_rounds = [streamed for task, streamed in sites.streamed if task in (P.SSL, P.TRAIN)]
    assert weight_rounds and all(weight_rounds)


def test_workflow_stops_when_there_is_no_common_class(tmp_path):
    def send(task, payloads):
        return {
            "cc-1": ({}, {"info": _info(["Hernia"], [12], [120])}),
            "cc-2": ({}, {"info": _info(["Mass"], [0], [0], n_labelled=0)}),
        }

    server, msgs = _server(tmp_path, send)
    with pytest.raises(RunStopped, match="no common class"):
        server.run()
    assert any("site cc-2 has no labelled training image" in m for m in msgs)


def test_resume_from_an_unknown_run_is_a_clear_stop(tmp_path):
    server, _ = _server(tmp_path, ScriptedSites(), resume_from="job-0")
    with pytest.raises(RunStopped, match=r"resume_from='job-0': .*cxrfl_resume/job-0 does not exist; give the job id"):
        server.run()


def test_the_old_resume_key_naming_a_folder_is_refused(tmp_path):
    # issue 40 point 2: the deprecated 'resume' took a folder the server then read
    from cxrfl.fl.fedfew import FedFew

    msgs = []
    common = dict(
        send=lambda t, p: {},
        sites=["a"],
        out_dir=tmp_path / "app",
        run_id="job-2",
        resume_root=tmp_path / "resume",
        info=msgs.append,
        warning=msgs.append,
        aborted=lambda: False,
    )
    with pytest.raises(ConfigError, match=r"^FedFew: resume='../earlier/fedfew' is no longer accepted.*resume_from"):
        FedFew(resume="../earlier/fedfew")
    assert FedFew(resume_from="job-1").make_server(**common).resume_from == "job-1"
    with pytest.raises(ConfigError, match=r"^resume_from='/earlier' is not a plain name"):
        FedFew(resume_from="/earlier").make_server(**common)
    server = FedFew(min_clients=2, min_clients_timeout=30, retry_pause=3).make_server(**common)
    assert (server.min_clients, server.clock.timeout, server.clock.pause) == (2, 30, 3)


def test_site_host_logs_one_line_per_task_and_tracks_the_losses():
    from types import SimpleNamespace

    host = P.FedFewSiteHost(SimpleNamespace(site="uc-1"))
    assert set(host.tasks) == set(P.TASKS)
    line = host.describe(P.DETECTORS, {}, {"prototypes": [], "refused": {"Hernia": "site uc-1: only 3 positive"}})
    assert line == "site uc-1: sent the prototypes of no class; refused: site uc-1: only 3 positive"
    sent = host.describe(P.DETECTORS, {}, {"scorers": [{"uc": "Edema"}], "refused": {}})
    assert sent == "site uc-1: sent the scorers of ['Edema']"
    answer = {"metrics": {"round": 2, "energy_weight": 0.1, "train_loss": 0.5, "steps": 3, "seconds": 1.25}}
    assert host.describe(P.TRAIN, {}, answer).startswith("site uc-1 stage 2 round 2 (lambda 0.1): train_loss 0.5000")
    assert host.scalars(P.TRAIN, answer) == ({"train_loss": 0.5}, 2)
    assert host.scalars(P.ENERGY, {"stats": {}}) is None
    val = host.describe(P.VALIDATE, {}, {"metrics": {"split": "val", "cc_loss": 0.25, "cc_mean_auroc": 0.6}})
    assert val == "site uc-1 val: CC loss 0.2500; CC mean AUROC 0.6000"
    uc = {"auroc": 0.9, "balanced_accuracy": 0.8, "f1": 0.75, "f1_flag_all": 0.667}
    test = host.describe(P.VALIDATE, {}, {"metrics": {"split": "test", "uc": {"Edema": uc}}})
    assert test.endswith("Edema AUROC 0.9000, balanced accuracy 0.8000, F1 0.7500 (flagging all: 0.6670)")


class RecordingHost:
    """A site host for :func:`cxrfl.common.transport.inprocess_transport`: keeps every task meta it
    receives (as JSON text) and answers as :class:`ScriptedSites` does."""

    tasks = P.TASKS

    def __init__(self, site, script):
        self.site, self.script, self.received = site, script, []

    def handle(self, task, params, meta):
        self.received.append(json.dumps(meta))
        return self.script.answer(task, self.site, params, meta)

    def describe(self, task, meta, answer):
        return None

    def scalars(self, task, answer):
        return None


def _foreign_ucs(texts, own, ucs):
    """The UC names other than ``own`` that any of the texts mentions (as whole words)."""
    hits = set()
    for text in texts:
        hits |= {uc for uc in ucs if uc not in own and re.search(rf"(?<![A-Za-z]){re.escape(uc)}(?![A-Za-z])", text)}
    return hits


def test_each_site_receives_only_its_own_underrepresented_classes(tmp_path):
    """Issue 40 point 8: every task carried the whole fedfew_config, so every site received the
    federation's list of UCs (fedfew.uc_classes); a site must receive its own UCs only."""
    from cxrfl.common.transport import inprocess_transport

    ucs = [UC, "Edema"]  # uc-1 labels Hernia; Edema is labelled at no site here
    script = ScriptedSites()
    hosts = {s: RecordingHost(s, script) for s in ("cc-1", "cc-2", "uc-1")}
    config = FedFewConfig.from_dict({**SMALL.to_dict(), "uc_classes": ucs})
    server, _ = _server(tmp_path, inprocess_transport(hosts), config=config, evaluate_test=True)
    server.run()
    own = {"cc-1": set(), "cc-2": set(), "uc-1": {UC}}
    for site, host in hosts.items():
        assert host.received, site
        assert _foreign_ucs(host.received, own[site], ucs) == set(), site
    # positive controls: the scan sees a UC name where one is sent (uc-1's own), and a planted one
    assert _foreign_ucs(hosts["uc-1"].received, set(), ucs) == {UC}
    assert _foreign_ucs([json.dumps({"fedfew_config": {"uc_classes": ["Edema"]}})], set(), ucs) == {"Edema"}
