"""The CWT benchmark's data preparation and summary (no training)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cxrfl.bench.cwt import (
    CENTRAL,
    TABLE_1,
    TABLE_3,
    BenchSettings,
    partition,
    prepare_data,
    scale_split,
    summarise,
)
from cxrfl.errors import DataError


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
    data = prepare_data(settings, repo_root / "site_configs" / "nih1000.yaml")
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
