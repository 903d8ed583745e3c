"""Pieces of `cxrfl bench speed`: the updates, the aggregators agree, payload sizes, the --json
summaries of the training and aggregation parts (tiny smoke runs), busy-loop load."""

from __future__ import annotations

import os

import numpy as np
from cxrfl.bench.speed import payload_benchmark
from cxrfl.bench.speed_aggregation import aggregate_with, make_updates
from cxrfl.bench.speed_report import speed_verdicts


def test_surgical_aggregation_of_the_body_equals_nvflare_fedavg():
    updates, shapes = make_updates(3)
    assert all(u["params"]["classifier.weight"].shape[0] == len(u["classes"]) for u in updates)
    ours, classes = aggregate_with("surgical", updates, shapes)
    component = aggregate_with("surgical_nvflare", updates, shapes)
    job = aggregate_with("round_aggregator", updates, shapes)
    theirs = aggregate_with("nvflare_fedavg", updates, shapes)
    from nvflare.apis.dxo import from_shareable

    fedavg = from_shareable(theirs).data
    for key in shapes:  # every feature-extractor entry: the plain mean, as NVFlare computes it
        if ours[key].dtype == np.float32:
            np.testing.assert_allclose(ours[key], fedavg[key], rtol=1e-5, atol=1e-6, err_msg=key)
        np.testing.assert_array_equal(component.params[key], ours[key])
        np.testing.assert_array_equal(job.params[key], ours[key])
    # a head row is the mean over the sites that have the class (NVFlare's FedAvg: over all sites)
    c = classes[0]
    having = [u for u in updates if c in u["classes"]]
    expected = np.mean([u["params"]["classifier.weight"][u["classes"].index(c)] for u in having], axis=0)
    np.testing.assert_allclose(ours["classifier.weight"][0], expected, rtol=1e-6)


def test_payload_is_the_feature_extractor_plus_own_rows(monkeypatch):
    # issue 44 point 3: the benchmark's flag compares byte counts only (the wrong rows weigh the same);
    # the surgical payloads it measures are checked entry by entry against the global model here
    from cxrfl.data.labels import CHEXPERT_CLASSES, NIH_CLASSES
    from cxrfl.nn.models import HEAD_PREFIX
    from cxrfl.surgical import head_modes

    sent = []

    def recording(global_params, global_classes, site_classes, **kw):
        out = real_payload_for(global_params, global_classes, site_classes, **kw)
        sent.append((global_params, list(global_classes), list(site_classes), kw["head_mode"], out[0]))
        return out

    real_payload_for = head_modes.payload_for
    monkeypatch.setattr(head_modes, "payload_for", recording)
    pay = payload_benchmark()
    surgical = [s for s in sent if s[3] == "surgical"]
    assert [s[2] for s in surgical] == [list(NIH_CLASSES), list(CHEXPERT_CLASSES)]
    for state, union, classes, _, params in surgical:
        body = [k for k in state if not k.startswith(HEAD_PREFIX)]
        assert list(params) == list(state) and len(body) == len(state) - 2
        for k in body:
            np.testing.assert_array_equal(params[k], state[k], err_msg=k)
        assert len({r.tobytes() for r in state[HEAD_PREFIX + "weight"]}) == len(union)  # rows tell apart
        rows = [union.index(c) for c in classes]
        np.testing.assert_array_equal(params[HEAD_PREFIX + "weight"], state[HEAD_PREFIX + "weight"][rows])
        np.testing.assert_array_equal(params[HEAD_PREFIX + "bias"], state[HEAD_PREFIX + "bias"][rows])
    for (site, rows), (*_, params) in zip(pay["sites"].items(), surgical):
        assert rows["surgical"]["raw_bytes"] == sum(v.nbytes for v in params.values()), site
        assert rows["surgical"]["equals_feature_extractor_plus_own_rows"], site
        assert rows["union (vanilla FL, partial loss)"]["raw_bytes"] == pay["full_model_bytes"]
        assert rows["local (personalized FL)"]["head_rows"] == 0
        assert rows["local + FedBN"]["raw_bytes"] < rows["local (personalized FL)"]["raw_bytes"]
    fake = {
        "aggregation": {
            "sites": {
                "10": {
                    "surgical": {"median_seconds": 0.12, "ratio_to_nvflare_fedavg": 1.2, "extra_model_sizes": 1.1},
                    "surgical_nvflare": {
                        "median_seconds": 0.2,
                        "ratio_to_nvflare_fedavg": 2.0,
                        "extra_model_sizes": 2.1,
                    },
                    "nvflare_fedavg": {"median_seconds": 0.1, "extra_model_sizes": 2.9},
                }
            }
        },
        "payload": pay,
    }
    text = " ".join(speed_verdicts(fake))
    assert "**MET** (0.120 s vs 0.100 s = 1.20x)" in text and "**NOT MET** (0.200 s = 2.00x)" in text


def test_only_some_parts_carries_the_others_over(tmp_path, monkeypatch):
    """`cxrfl bench speed --only aggregation,payload` reruns those and keeps the earlier simulator numbers."""
    import json

    import pytest
    from cxrfl.bench import speed
    from cxrfl.cli import build_parser
    from cxrfl.errors import ConfigError

    sim = {
        "simulator_images_per_second": [29.0],
        "simulator_mean": 29.0,
        "simulator_wall_seconds": 70.0,
        "plain_before": {"images_per_second": [30.0], "mean": 30.0},
        "plain_after": {"images_per_second": [28.0], "mean": 28.0},
        "plain_mean": 29.3,
        "ratio": 0.99,
        "command": "nvflare simulator ...",
    }
    earlier_settings = {**speed.asdict(speed.SpeedSettings()), "rounds": 5}
    (tmp_path / "speed.json").write_text(
        json.dumps(
            {
                "settings": earlier_settings,
                "command": "cxrfl bench speed --rounds 5",
                "machine": {"load_average_at_start": [1.0, 2.0, 3.0]},
                "simulator": sim,
            }
        )
    )
    ran = []
    monkeypatch.setattr(speed, "simulator_vs_plain", lambda *a, **k: ran.append("simulator"))
    monkeypatch.setattr(
        speed, "aggregation_benchmark", lambda *a, **k: ran.append("aggregation") or {"model_bytes": 1, "sites": {}}
    )
    monkeypatch.setattr(speed, "payload_benchmark", lambda: ran.append("payload") or {})
    args = build_parser().parse_args(
        ["bench", "speed", "--out", str(tmp_path), "--threads", "1", "--only", "aggregation,payload"]
    )
    assert args.func(args) == 0
    assert ran == ["aggregation", "payload"]
    res = json.loads((tmp_path / "speed.json").read_text())
    assert res["simulator"] == sim and res["carried_over"]["simulator"]["command"] == "cxrfl bench speed --rounds 5"
    md = (tmp_path / "speed.md").read_text()
    assert (
        "carried over from an earlier run: `cxrfl bench speed --rounds 5` (load average at its start 1.0, 2.0, 3.0)"
        in md
    )
    load = ", ".join(f"{x:.1f}" for x in res["machine"]["load_average"])
    assert (
        f"Machine: {os.cpu_count()} CPU cores, CPU only, 1 torch thread(s) for training; load average at start {load}."
        in md
    )
    assert "5 rounds" in md and "**0.99x**" in md  # the earlier run's settings, not this one's
    speed.run_speed(
        speed.SpeedSettings(parts=("aggregation",)), tmp_path, log=lambda m: None
    )  # carried twice: same source
    res = json.loads((tmp_path / "speed.json").read_text())
    assert (
        res["carried_over"]["simulator"]["command"] == "cxrfl bench speed --rounds 5"
        and "payload" in res["carried_over"]
    )
    with pytest.raises(ConfigError, match=r"bench\.parts must name some of .* \(--only\), got 'throughput'"):
        speed.run_speed(speed.SpeedSettings(parts=("throughput",)), tmp_path)


def test_training_part_prints_one_json_object_measured_in_this_run(tmp_path, capsys):
    """`cxrfl bench speed --only training --json` (tiny settings): both settings measured, the ratio theirs."""
    import json

    from cxrfl.cli import build_parser
    from cxrfl.nn.precision import resolve

    args = build_parser().parse_args(
        [
            "bench",
            "speed",
            "--out",
            str(tmp_path),
            "--only",
            "training",
            "--json",
            "--image-size",
            "32",
            "--training-batch-size",
            "4",
            "--steps",
            "2",
            "--rounds",
            "2",
            "--threads",
            "1",
        ]
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["training"]
    tr = out["training"]
    default = resolve("auto", "auto", "cpu")
    assert (tr["precision"], tr["channels_last"], tr["threads"]) == (default.precision, default.channels_last, 1)
    assert (
        tr["fp32_img_s"] > 0
        and tr["default_img_s"] > 0
        and abs(tr["ratio"] - tr["default_img_s"] / tr["fp32_img_s"]) < 1e-9
    )
    saved = json.loads((tmp_path / "speed.json").read_text())
    assert len(saved["training"]["images_per_second"]["fp32"]) == 2 and "carried_over" not in saved


def test_aggregation_summary_with_busy_cores():
    import psutil
    import torch
    from cxrfl.bench.speed_aggregation import aggregation_benchmark, aggregation_summary, busy_cores

    with busy_cores(2) as pids:
        assert len(pids) == 2 and all(psutil.Process(p).is_running() for p in pids)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    before = torch.get_num_threads()
    agg = aggregation_benchmark((2,), 1, busy=1, memory=False, log=lambda m: None)
    summary = aggregation_summary(agg)
    assert torch.get_num_threads() == before and summary["threads"] == before and summary["busy"] == 1
    assert summary["sites"] == 2 and summary["surgical_s"] == agg["sites"]["2"]["round_aggregator"]["median_seconds"]
    assert summary["ratio"] == summary["surgical_s"] / summary["nvflare_s"]
