"""The CWT benchmark: data preparation (every usable real image, by patient, exact splits), the
summary with its paired statistics, and a tiny end-to-end run over both datasets with its output
contract."""

from __future__ import annotations

import json
import math
import os

import cxrfl.bench.cwt as bench
import numpy as np
import pandas as pd
import pytest
from cxrfl.bench.cwt import CWTBenchSettings, run_cwt_benchmark
from cxrfl.bench.cwt_data import TABLE_1, TABLE_3, partition, prepare_data, scale_split
from cxrfl.bench.cwt_report import CENTRAL, provenance, results_table, stopping, stopping_line, summarise
from cxrfl.bench.protocol import code_version
from cxrfl.errors import DataError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_paper_tables_scale_with_exact_sums():
    for table in (TABLE_1, TABLE_3):
        for rows in table.values():
            assert sum(r[0] for r in rows) == sum(r[1] for r in rows) == 3200
    assert scale_split(TABLE_1[5], 200) == [(90, 90), (63, 63), (37, 37), (10, 10)]
    assert scale_split(TABLE_3[10], 200) == [(90, 10), (63, 37), (37, 63), (10, 90)]
    assert scale_split(TABLE_1[1], 200) == [(50, 50)] * 4
    for split in (*TABLE_1, *TABLE_3):
        rows = scale_split({**TABLE_1, **TABLE_3}[split], 173)
        assert sum(r[0] for r in rows) == sum(r[1] for r in rows) == 173


def test_partition_meets_the_quotas_with_whole_patients():
    rng = np.random.default_rng(0)
    patients = pd.DataFrame(
        {"patient": [f"p{i}" for i in range(60)], "a": rng.integers(0, 3, 60), "b": rng.integers(0, 3, 60)}
    )
    total_a, total_b = int(patients["a"].sum()), int(patients["b"].sum())
    quotas = [
        (total_a // 2, total_b - 3 * (total_b // 4)),
        (total_a // 4, total_b // 4),
        (total_a - total_a // 2 - total_a // 4, 2 * (total_b // 4)),
    ]
    choice = partition(patients, quotas, np.random.default_rng(1))
    assert set(choice) == set(patients["patient"])
    for site, (qa, qb) in enumerate(quotas):
        mine = patients[patients["patient"].map(choice) == site]
        assert (int(mine["a"].sum()), int(mine["b"].sum())) == (qa, qb)
    with pytest.raises(DataError):
        partition(
            pd.DataFrame({"patient": ["big"], "a": [2], "b": [0]}), [(1, 0), (1, 0)], np.random.default_rng(0), tries=5
        )


def test_real_nih_splits_use_every_usable_image_by_patient_and_exactly(shared_data, repo_root):
    settings = CWTBenchSettings()
    data = prepare_data(**settings.data_args("nih1000"), site_config=repo_root / "site_configs" / "nih1000.yaml")
    pt = {name: set(df["patient"]) for name, df in (("test", data.test), ("val", data.val), ("train", data.train))}
    assert not (pt["test"] & pt["val"]) and not (pt["test"] & pt["train"]) and not (pt["val"] & pt["train"])
    n = int(data.train["y"].sum())
    assert len(data.train) == 2 * n and int(data.test["y"].sum()) == settings.test_per_class
    assert len(data.test) == 2 * settings.test_per_class and len(data.val) == 2 * settings.val_per_class
    # every usable image: at most 20 per patient leaves 415 abnormal images; all of them in use, balanced
    assert n + settings.test_per_class + settings.val_per_class >= 400
    assert data.train.groupby("patient").size().max() <= settings.max_patient_images
    for split in settings.splits:
        sites = data.sites(split)
        got = [
            (int(s.split_table("train")["Abnormal"].sum()), int((s.split_table("train")["Abnormal"] == 0).sum()))
            for s in sites
        ]
        assert got == data.splits[split] and sum(a for a, _ in got) == n
        seen = [set(s.split_table("train")["patient"]) for s in sites]
        assert sum(len(x) for x in seen) == len(set().union(*seen)) == len(pt["train"])  # every patient at one site
    assert data.assignment[1] == data.assignment[6]  # the same counts, the same partition


def test_summary_reports_percent_of_central_and_the_targets_with_paired_statistics():
    runs = []
    for seed, (c, v, p, lw, cw) in enumerate([(0.70, 0.60, 0.66, 0.64, 0.66), (0.72, 0.62, 0.70, 0.60, 0.63)]):
        runs.append({"seed": seed, "split": 0, "method": CENTRAL, "accuracy": c, "auroc": c})
        runs += [
            {"seed": seed, "split": 5, "method": m, "accuracy": a, "auroc": a}
            for m, a in (("CWT", v), ("CWT+PLTI", p), ("CWT+CLR", v))
        ]
        runs += [
            {"seed": seed, "split": 10, "method": m, "accuracy": a, "auroc": a}
            for m, a in (("CWT", v), ("CWT+LWMS", lw), ("CWT+CWL", cw))
        ]
    s = summarise(runs, "synthetic", (5, 10), test_images=200, seeds=2)
    assert s["splits"]["5"]["CWT"]["percent_of_central_accuracy"] == pytest.approx(100 * 0.61 / 0.71)
    t = s["targets"]["split5_plti"]
    # gaps to central: vanilla 0.10 and 0.10, PLTI 0.04 and 0.02: closer by 0.06 and 0.08
    assert t["met"] and t["accuracy"]["difference"] == pytest.approx(0.07)
    assert t["significant"] == (t["accuracy"]["p_one_sided"] < 0.05) and t["significant"]  # one-sided p = 0.045
    assert t["accuracy"]["gap_to_central"]["CWT+PLTI"]["mean"] == pytest.approx(0.03)
    # t = 0.07 / (0.01 * sqrt 2 / sqrt 2) = 7 with 1 d.f.: two-sided p = 1 - 2 atan(7) / pi
    assert t["accuracy"]["p"] == pytest.approx(1 - 2 * math.atan(7) / math.pi)
    assert t["accuracy"]["d_z"] == pytest.approx(0.07 / (0.01 * math.sqrt(2)))
    lw = s["targets"]["split10_lwms"]
    assert lw["met"] and lw["accuracy"]["per_seed"] == pytest.approx([0.04, -0.02])
    assert not lw["significant"]  # +0.01 with an SD of 0.04 over 2 seeds
    assert s["targets"]["split10_cwl"]["met"]
    c = s["targets"]["central_auroc"]
    assert c["met"] and c["stats"]["reference"] == 0.7 and c["stats"]["difference"] == pytest.approx(0.01)
    assert not summarise(runs, "nih1000", (5,), 200, 2)["targets"]["central_auroc"]["target"].startswith(
        "central hosting AUROC >="
    )
    assert s["noise"]["binomial_sd_of_accuracy"] == pytest.approx(math.sqrt(0.71 * 0.29 / 200))
    table = results_table(runs)
    assert table[CENTRAL]["all"]["accuracy_mean"] == pytest.approx(0.71)
    assert table["CWT+PLTI"]["5"]["per_seed"]["1"]["accuracy"] == 0.70
    assert table["CWT+LWMS"]["10"]["auroc_mean"] == pytest.approx(0.62) and table["CWT"]["10"]["n_seeds"] == 2


def test_provenance_counts_the_code_machine_and_time_of_each_trained_run():
    m = {"cpu": "Xeon", "cores": 2, "torch_threads": 1}
    runs = [
        {"seconds": 10.0, "code": {"commit": "abcdef0123", "dirty": False}, "machine": m},
        {"seconds": 20.5, "code": {"commit": "abcdef0123", "dirty": False}, "machine": m},
        {"seconds": 5.0, "code": {"commit": "1234567890", "dirty": True}, "machine": m},
        {"seconds": 20.5, "code": {"commit": "abcdef0123", "dirty": False}, "machine": m, "same_as": "split 1 CWT"},
        {"seconds": 7.0},
    ]  # kept before runs recorded their code and machine
    p = provenance(runs)
    assert (p["trained_runs"], p["reused_runs"], p["training_seconds"]) == (4, 1, 42.5)
    assert p["code"] == [
        {"commit": "abcdef0", "dirty": False, "runs": 2},
        {"commit": "1234567", "dirty": True, "runs": 1},
        {"commit": "unknown", "dirty": False, "runs": 1},
    ]
    assert p["machines"] == [
        {"machine": "Xeon, 2 cores, 1 torch thread(s)", "runs": 3},
        {"machine": "not recorded", "runs": 1},
    ]


def test_the_report_names_every_run_that_reached_the_cycle_cap_still_improving():
    def run(split, method, seed, stopped_early, best, ran, **extra):
        return {
            "split": split,
            "method": method,
            "seed": seed,
            "accuracy": 0.6,
            "auroc": 0.6,
            "stopped_early": stopped_early,
            "best_cycle": best,
            "cycles_run": ran,
            **extra,
        }

    runs = [
        run(0, CENTRAL, 0, True, 30, 40),
        run(10, "CWT", 1, False, 79, 80),
        run(5, "CWT+PLTI", 0, True, 12, 22),
        run(0, CENTRAL, 1, False, 80, 80),
        run(6, "CWT", 1, False, 79, 80, same_as="split 1 CWT"),
    ]  # reported as another run: not counted
    s = stopping(runs)
    assert (s["trained_runs"], s["stopped_early"]) == (4, 2)
    assert [(r["split"], r["method"], r["seed"], r["best_cycle"]) for r in s["reached_cap"]] == [
        (0, CENTRAL, 1, 80),
        (10, "CWT", 1, 79),
    ]
    assert stopping_line(s, 10) == (
        "- Stopping: 2 of 4 trained runs stopped after 10 cycles without a lower validation loss; 2 reached the cycle "
        "cap with the loss still falling: central hosting seed 1 (best cycle 80 of 80); split 10 CWT seed 1 "
        "(best cycle 79 of 80)."
    )
    assert stopping_line(stopping(runs[:1]), 10).endswith(
        "1 of 1 trained runs stopped after 10 cycles without a lower validation loss; none reached the cycle cap."
    )
    assert results_table(runs)["CWT"]["10"]["per_seed"]["1"]["stopped_early"] is False


def test_kept_runs_are_reused_under_a_higher_cycle_cap_only_where_early_stopping_ended_them(tmp_path):
    key = CWTBenchSettings(cycles=80).run_key("nih1000", 530)
    old = {**key, "cycles": 40}

    def keep(name, settings, stopped_early, cycles_run):
        run = {"seed": 0, "split": 5, "method": name, "stopped_early": stopped_early, "cycles_run": cycles_run}
        (tmp_path / f"{name}.json").write_text(json.dumps({"settings": settings, "run": run}))

    keep("stopped-at-23", old, True, 23)  # the cap of 40 never bound it: the same run under 80
    keep("patience-at-the-cap", old, True, 40)  # early stopping fired at cycle 40 itself
    keep("hit-the-cap", old, False, 40)  # still improving at 40: must be trained again
    keep("same-cap", key, False, 80)
    keep("stopped-beyond-cap", {**key, "cycles": 120}, True, 95)  # would have been cut at 80
    keep("other-lr", {**old, "lr": 1e-4}, True, 12)
    keep("before-arch", {k: v for k, v in key.items() if k != "arch"}, False, 80)  # kept before arch: DenseNet121
    keep("tiny", {**key, "arch": "densenet-tiny"}, False, 80)
    (tmp_path / "broken.json").write_text("{")
    assert key["arch"] == "densenet121"
    assert sorted(m for _, _, m in bench.load_runs(tmp_path, key)) == [
        "before-arch",
        "patience-at-the-cap",
        "same-cap",
        "stopped-at-23",
    ]
    assert [m for _, _, m in bench.load_runs(tmp_path, {**key, "arch": "densenet-tiny"})] == ["tiny"]
    assert sorted(m for _, _, m in bench.load_runs(tmp_path, old)) == [
        "hit-the-cap",
        "patience-at-the-cap",
        "stopped-at-23",
    ]


def test_a_tiny_benchmark_writes_its_outputs_and_goes_on_from_the_kept_runs(
    tmp_path, shared_data, repo_root, monkeypatch
):
    trained = []
    real = bench.run_cwt

    def counting(sites, config, out_dir=None, *, model_config, **kw):
        assert model_config.arch == "densenet-tiny"  # the settings' network reaches every run
        trained.append((len(sites), config.method))
        return real(sites, config, out_dir, model_config=model_config, **kw)

    monkeypatch.setattr(bench, "run_cwt", counting)
    settings = CWTBenchSettings(
        image_size=32,
        arch="densenet-tiny",  # the network is not the subject: the protocol, outputs and resuming are
        per_class=24,
        test_per_class=10,
        val_per_class=6,
        cycles=1,
        patience=1,
        batch_size=16,
        augment=False,
        splits=(5,),
        jobs=1,
        synthetic_images=240,
        synthetic_per_class=20,
        synthetic_test_per_class=10,
        synthetic_val_per_class=5,
        synthetic_splits=(1,),
        max_patient_images=4,
    )
    site_config = repo_root / "site_configs" / "nih1000.yaml"
    out = tmp_path / "cwt"
    kw = dict(settings=settings, site_config=site_config, data_root=tmp_path / "data", log=lambda m: None)
    result = run_cwt_benchmark(out, 1, **kw)
    # real: central hosting (one site), then vanilla CWT, PLTI and CLR over the 4 institutions of split 5;
    # synthetic: central hosting and split 1 (equal sites: PLTI and CLR are vanilla CWT, not trained again)
    assert trained == [(1, "CWT"), (4, "CWT"), (4, "CWT+PLTI"), (4, "CWT+CLR"), (1, "CWT"), (4, "CWT")]
    saved = json.loads((out / "results.json").read_text())
    assert saved["settings"]["arch"] == "densenet-tiny"
    for dataset, method, split in (
        ("nih1000", CENTRAL, "all"),
        ("nih1000", "CWT+CLR", "5"),
        ("synthetic", CENTRAL, "all"),
        ("synthetic", "CWT+PLTI", "1"),
    ):
        cell = saved["results"][dataset][method][split]
        assert 0 <= cell["accuracy_mean"] <= 1 and 0 <= cell["auroc_mean"] <= 1
        assert set(cell["per_seed"]) == {"0"}
    assert saved["results"]["synthetic"]["CWT+PLTI"]["1"]["per_seed"]["0"]["same_as"] == "split 1 CWT"
    assert saved["datasets"]["synthetic"]["data"]["test_images"] == 20
    assert saved["datasets"]["nih1000"]["summary"]["targets"]["split5_plti"]["target"].startswith("split 5")
    assert result["results"] == saved["results"]
    code = code_version()
    assert saved["provenance"]["code"] == [{"commit": code["commit"][:7], "dirty": code["dirty"], "runs": 6}]
    assert (saved["provenance"]["trained_runs"], saved["provenance"]["reused_runs"]) == (6, 2)
    report = (out / "report.md").read_text()
    assert (
        f"- Code: `{code['commit'][:7]}`" in report and "6 runs trained (2 more reported as an identical run)" in report
    )
    load = ", ".join(f"{x:.1f}" for x in saved["machine"]["load_average"])
    assert saved["machine"]["cores"] == os.cpu_count() and f"(load average at its start {load})" in report
    assert "| 5 |" in report and "split 5: CWT+PLTI closer to central hosting" in report and "## synthetic" in report
    t = saved["datasets"]["nih1000"]["summary"]["targets"]["split5_plti"]
    verdict = (
        ("**met**, significant" if t["significant"] else "**met** in the mean, not significant")
        if t["met"]
        else "**not met**"
    )
    assert f"{t['target']}: {verdict}" in report
    for png in ("cwt_nih1000.png", "cwt_curves_nih1000.png", "cwt_synthetic.png", "cwt_curves_synthetic.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    kept = sorted(p.name for p in (out / "runs" / "nih1000").iterdir())
    assert kept == [
        "CWT+CLR__split5__seed0.json",
        "CWT+PLTI__split5__seed0.json",
        "CWT__split5__seed0.json",
        "Central_hosting__split0__seed0.json",
    ]
    (out / "runs" / "nih1000" / "CWT+CLR__split5__seed0.json").unlink()  # as if the benchmark had stopped before it
    trained.clear()
    again = run_cwt_benchmark(out, 1, **kw)
    assert trained == [(4, "CWT+CLR")]  # only the missing run is trained again
    assert again["results"]["nih1000"][CENTRAL] == saved["results"]["nih1000"][CENTRAL]
