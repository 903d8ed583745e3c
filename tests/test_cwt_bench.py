"""The CWT benchmark: data preparation, summary, and a tiny end-to-end run with its output contract."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import cxrfl.bench.cwt as bench
from cxrfl.bench.cwt import CENTRAL, BenchSettings, results_table, run_cwt_benchmark, summarise
from cxrfl.bench.cwt_data import TABLE_1, TABLE_3, partition, prepare_data, scale_split
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
    patients = pd.DataFrame({"patient": [f"p{i}" for i in range(60)],
                             "a": rng.integers(0, 3, 60), "b": rng.integers(0, 3, 60)})
    total_a, total_b = int(patients["a"].sum()), int(patients["b"].sum())
    quotas = [(total_a // 2, total_b - 3 * (total_b // 4)), (total_a // 4, total_b // 4),
              (total_a - total_a // 2 - total_a // 4, 2 * (total_b // 4))]
    choice = partition(patients, quotas, np.random.default_rng(1))
    assert set(choice) == set(patients["patient"])
    for site, (qa, qb) in enumerate(quotas):
        mine = patients[patients["patient"].map(choice) == site]
        assert (int(mine["a"].sum()), int(mine["b"].sum())) == (qa, qb)
    with pytest.raises(DataError):
        partition(pd.DataFrame({"patient": ["big"], "a": [2], "b": [0]}), [(1, 0), (1, 0)], np.random.default_rng(0), tries=5)


def test_real_nih_splits_are_by_patient_and_exact(shared_data, repo_root):
    settings = BenchSettings()
    data = prepare_data(per_class=settings.per_class, test_per_class=settings.test_per_class,
                        val_per_class=settings.val_per_class, max_patient_images=settings.max_patient_images,
                        site_config=repo_root / "site_configs" / "nih1000.yaml")
    pt = {name: set(df["patient"]) for name, df in (("test", data.test), ("val", data.val), ("train", data.train))}
    assert not (pt["test"] & pt["val"]) and not (pt["test"] & pt["train"]) and not (pt["val"] & pt["train"])
    assert int(data.train["y"].sum()) == settings.per_class and len(data.train) == 2 * settings.per_class
    assert int(data.test["y"].sum()) == settings.test_per_class and len(data.test) == 2 * settings.test_per_class
    assert data.train.groupby("patient").size().max() <= settings.max_patient_images
    for split in settings.splits:
        sites = data.sites(split)
        got = [(int(s.split_table("train")["Abnormal"].sum()), int((s.split_table("train")["Abnormal"] == 0).sum())) for s in sites]
        assert got == data.splits[split]
        seen = [set(s.split_table("train")["patient"]) for s in sites]
        assert sum(len(x) for x in seen) == len(set().union(*seen)) == len(pt["train"])  # every patient at one site
    assert data.assignment[1] == data.assignment[6]  # the same counts, the same partition


def test_summary_reports_percent_of_central_and_the_targets():
    runs = []
    for seed, (c, v, p, lw, cw) in enumerate([(0.70, 0.60, 0.66, 0.64, 0.66), (0.72, 0.62, 0.70, 0.60, 0.63)]):
        runs.append({"seed": seed, "split": 0, "method": CENTRAL, "accuracy": c, "auroc": c})
        runs += [{"seed": seed, "split": 5, "method": m, "accuracy": a, "auroc": a}
                 for m, a in (("CWT", v), ("CWT+PLTI", p), ("CWT+CLR", v))]
        runs += [{"seed": seed, "split": 10, "method": m, "accuracy": a, "auroc": a}
                 for m, a in (("CWT", v), ("CWT+LWMS", lw), ("CWT+CWL", cw))]
    s = summarise(runs, BenchSettings(splits=(5, 10)))
    assert s["splits"]["5"]["CWT"]["percent_of_central_accuracy"] == pytest.approx(100 * 0.61 / 0.71)
    t = s["targets"]["split5_plti"]
    assert t["met"] and t["accuracy"]["diff"]["mean"] == pytest.approx(0.07)
    assert t["accuracy"]["gap_to_central"]["CWT+PLTI"]["mean"] == pytest.approx(0.03)
    assert s["targets"]["split10_lwms"]["met"] and s["targets"]["split10_cwl"]["met"]
    assert s["targets"]["split10_lwms"]["accuracy"]["per_seed"] == pytest.approx([0.04, -0.02])
    table = results_table(runs)
    assert table[CENTRAL]["all"]["accuracy_mean"] == pytest.approx(0.71)
    assert table["CWT+PLTI"]["5"]["per_seed"]["1"]["accuracy"] == 0.70
    assert table["CWT+LWMS"]["10"]["auroc_mean"] == pytest.approx(0.62) and table["CWT"]["10"]["n_seeds"] == 2


def test_a_tiny_benchmark_writes_its_outputs_and_goes_on_from_the_kept_runs(tmp_path, shared_data, repo_root, monkeypatch):
    trained = []
    real = bench.run_cwt

    def counting(sites, model_config, config, **kw):
        trained.append((len(sites), config.method))
        return real(sites, model_config, config, **kw)

    monkeypatch.setattr(bench, "run_cwt", counting)
    settings = BenchSettings(image_size=32, per_class=24, test_per_class=10, val_per_class=6, cycles=1, patience=1,
                             batch_size=16, augment=False, splits=(5,))
    site_config = repo_root / "site_configs" / "nih1000.yaml"
    out = tmp_path / "cwt"
    result = run_cwt_benchmark(out, 1, settings=settings, site_config=site_config, log=lambda m: None)
    # central hosting (one site), then vanilla CWT, PLTI and CLR over the 4 institutions of split 5
    assert trained == [(1, "CWT"), (4, "CWT"), (4, "CWT+PLTI"), (4, "CWT+CLR")]
    saved = json.loads((out / "results.json").read_text())
    for method, split in ((CENTRAL, "all"), ("CWT", "5"), ("CWT+PLTI", "5"), ("CWT+CLR", "5")):
        cell = saved["results"][method][split]
        assert 0 <= cell["accuracy_mean"] <= 1 and 0 <= cell["auroc_mean"] <= 1
        assert set(cell["per_seed"]) == {"0"}
    assert saved["summary"]["targets"]["split5_plti"]["target"].startswith("split 5")
    assert result["results"] == saved["results"]
    report = (out / "report.md").read_text()
    assert "| 5 |" in report and "split 5: CWT+PLTI closer to central hosting" in report
    for png in ("cwt.png", "cwt_curves.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    kept = sorted(p.name for p in (out / "runs").iterdir())
    assert kept == ["CWT+CLR__split5__seed0.json", "CWT+PLTI__split5__seed0.json", "CWT__split5__seed0.json",
                    "Central_hosting__split0__seed0.json"]
    (out / "runs" / "CWT+CLR__split5__seed0.json").unlink()  # as if the benchmark had stopped before it
    trained.clear()
    again = run_cwt_benchmark(out, 1, settings=settings, site_config=site_config, log=lambda m: None)
    assert trained == [(4, "CWT+CLR")]  # only the missing run is trained again
    assert again["results"][CENTRAL] == saved["results"][CENTRAL]
