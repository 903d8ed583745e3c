"""`cxrfl bench compare` end to end on a tiny profile, and the pieces of its statistics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cxrfl.bench.profiles import partition_classes, pooled_site
from cxrfl.bench.report import format_report
from cxrfl.bench.report_text import num_text
from cxrfl.bench.selection_cost import run_cost
from cxrfl.data.labels import NIH_CLASSES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        str(Path(sys.executable).with_name("cxrfl")),
        "bench",
        "compare",
        "--profile",
        "two-hospitals",
        "--out",
        str(out / "res"),
        "--data-dir",
        str(out / "data"),
        "--seeds",
        "1",
        "--max-rounds",
        "1",
        "--steps",
        "1",
        "--batch-size",
        "8",
        "--image-size",
        "32",
        "--data-image-size",
        "32",
        "--n-per-site",
        "30",
        "--n-external",
        "30",
        "--n-boot",
        "20",
        "--threads",
        "1",
        "--methods",
        "individual,vanilla-fedavg,pfl-fedavg,partial-fedavg",
        "--arch",
        "densenet-tiny",  # the network is not the subject: the protocol, results and report are
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "surgical-fedavg: round 1: 2 of 2 site(s) aggregated" in proc.stdout  # progress lines while it runs
    return out / "res"


def test_results_json_structure(compare_run):
    res = json.loads((compare_run / "results.json").read_text())
    assert res["profile"] == "two-hospitals" and res["reference"] == "surgical-fedavg"
    assert set(res["methods"]) == {
        "individual:hospital-a",
        "individual:hospital-b",
        "pfl-fedavg",
        "vanilla-fedavg",
        "partial-fedavg",
        "surgical-fedavg",
    }
    assert set(res["views"]) == {"hospital-a", "hospital-b", "external", "external@hospital-a", "external@hospital-b"}
    assert len(res["data"]["shared_classes"]) == 7 and len(res["data"]["union"]) == 20
    assert res["seeds"] == [0] and res["settings"]["max_rounds"] == 1 and res["settings"]["arch"] == "densenet-tiny"
    machine = res["machines"][0]
    assert machine["runs"] == 6 and machine["cpu"] and machine["torch_threads"] == 1 and machine["device"] == "cpu"
    for name, m in res["methods"].items():
        run = m["runs"][0]
        assert len(m["runs"]) == 1 and run["rounds"] == 1 and run["seed"] == 0 and run["seconds"] > 0
        assert run["code"]["commit"] and "cpu" in run["machine"]
        # learning curves: the warmed-up model and the model of round 1 (scored by a final validation task)
        assert run["curve_rounds"] == [0, 1] and len(run["val_loss"]) == len(run["val_auroc"]) == 2
        assert run["best_round"] == (1 if run["val_loss"][1] < run["val_loss"][0] - 1e-4 else 0)  # min_delta 1e-4
        sites = ["hospital-a", "hospital-b"] if m["kind"] == "federated" else [m["site"]]
        assert set(run["site_val_loss"]) == set(run["site_val_auroc"]) == set(sites)
        for site in sites:
            assert len(run["site_val_loss"][site]) == 2
        assert run["val_loss"][0] == pytest.approx(np.mean([run["site_val_loss"][s][0] for s in sites]))
        for view, cell in m["test"].items():
            assert set(cell["auroc"]) == set(res["views"][view]["classes"])
            for key in (
                "mean",
                "sd",
                "n",
                "ci",
                "mean_ci",
                "mean_by_seed",
                "auroc_by_seed",
                "vs_reference",
                "model_knows",
            ):
                assert key in cell, (name, view, key)
            assert [set(a) for a in cell["auroc_by_seed"]] == [set(cell["auroc"])]  # per seed, per class
            for c, v in cell["auroc"].items():
                assert v is None or 0.0 <= v <= 1.0
                assert (cell["ci"][c] is None) == (v is None)
            if name == "surgical-fedavg":
                assert cell["vs_reference"] is None
            elif cell["mean"] is not None:
                by_class = cell["vs_reference"]["all"]["classes"]
                assert {"difference", "ci", "d_z", "t", "p", "wilcoxon_p", "shapiro_p", "n"} <= set(by_class)
                ref = res["methods"]["surgical-fedavg"]["test"][view]
                assert by_class["difference"] == pytest.approx(ref["mean"] - cell["mean"])  # SA - method
    a = res["methods"]["individual:hospital-a"]["test"]
    # a model that does not know a class: not defined (None), never 0.5, and no mean over a set containing it
    b_only = [c for c in res["views"]["hospital-b"]["classes"] if c not in res["views"]["hospital-a"]["classes"]]
    assert all(a["hospital-b"]["auroc"][c] is None for c in b_only)
    assert a["hospital-b"]["mean"] is None and a["external"]["mean"] is None
    assert a["hospital-b"]["unique"]["mean"] is None and a["hospital-b"]["unique"]["unknown"] == sorted(b_only)
    assert res["methods"]["pfl-fedavg"]["test"]["external"]["mean"] is None  # no single model
    assert res["methods"]["pfl-fedavg"]["test"]["external@hospital-a"]["model_knows"]
    for view in ("hospital-a", "hospital-b"):
        cell = res["methods"]["surgical-fedavg"]["test"][view]
        assert {"shared", "unique"} <= set(cell)
    assert isinstance(res["targets"], list) and res["targets"]
    for t in res["targets"]:
        assert {"target", "view", "met", "difference", "classes", "seeds"} <= set(t)
    assert (compare_run / "runs" / "surgical-fedavg" / "seed-0.json").is_file()  # each run stored as it finished


def test_report_has_the_papers_tables(compare_run):
    text = (compare_run / "report.md").read_text()
    assert "; densenet-tiny from scratch at 32x32 px" in text  # the network the runs trained, not DenseNet121
    for heading in (
        "## Mean AUROC, all classes",
        "## Shared vs unique classes",
        "## External set by each site's classes",
        "## Per-class AUROC",
        "## Targets",
        "## Plots",
    ):
        assert heading in text
    assert "| FL + SA (FedAvg) |" in text and "| hospital-a (individual) |" in text
    assert "hospital-a shared | hospital-a unique" in text
    assert "external, hospital-b classes" in text
    assert "## Convergence" in text and "## Against surgical aggregation: effect sizes and tests" in text
    assert "Wilcoxon p" in text and "d_z" in text
    # each method's validation AUROC given up by the selection rule, from its runs' stored curves
    convergence = text.split("## Convergence")[1].split("\n## ")[0]
    runs = json.loads((compare_run / "results.json").read_text())["methods"]["surgical-fedavg"]["runs"]
    costs = [max(r["val_auroc"]) - r["val_auroc"][r["curve_rounds"].index(r["best_round"])] for r in runs]
    assert costs == [run_cost(r) for r in runs]
    (row,) = [line for line in convergence.splitlines() if line.startswith("| FL + SA (FedAvg) |")]
    assert row.endswith(f"| {num_text(sum(costs) / len(costs))} |")
    # a method whose selection gave up 0.3 of validation AUROC is marked in every effect table
    res = json.loads((compare_run / "results.json").read_text())
    m = res["machines"][0]  # the machine line names the CPU's capability, which decides its speed
    assert f"{m['cpu']} (torch CPU capability {m['cpu_capability']}, native bf16 " in text
    res["methods"]["vanilla-fedavg"]["runs"] = [
        {**r, "curve_rounds": [0, 1], "val_auroc": [0.5, 0.8], "best_round": 0}
        for r in res["methods"]["vanilla-fedavg"]["runs"]
    ]
    effects = format_report(res).split("## Against surgical aggregation")[1].split("\n## ")[0]
    assert "| FL (FedAvg) (NOT A RESULT: selection gave up 0.300) |" in effects
    assert "| FL (FedAvg) |" not in effects and "| FL + PL (FedAvg) |" in effects


def test_plots_are_non_empty_pngs(compare_run):
    res = json.loads((compare_run / "results.json").read_text())
    names = set(res["plots"])
    assert {
        "auroc_hospital-a.png",
        "auroc_hospital-b.png",
        "auroc_external.png",
        "roc_external.png",
        "learning_curves.png",
    } <= names
    for name in names:
        data = (compare_run / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name


# ------------------------------------------------------------------ pieces
def test_partition_classes_for_the_ablations():
    classes = list(NIH_CLASSES)
    midl = partition_classes(classes, 2, 4, seed=0, unique_sizes=(7, 3))
    assert [len(s) for s in midl] == [11, 7] and len(set(midl[0]) & set(midl[1])) == 4
    for k in (2, 3, 4, 5, 6, 8, 10):
        sets = partition_classes(classes, k, 4, seed=1)
        assert set().union(*map(set, sets)) == set(classes)  # every class annotated somewhere
        assert len(set.intersection(*map(set, sets))) == 4
    for shared in (0, 1, 2, 4, 8, 12, 14):
        sets = partition_classes(classes, 4, shared, seed=2)
        assert len(set.intersection(*map(set, sets))) == shared and set().union(*map(set, sets)) == set(classes)


def test_pooled_site_marks_missing_labels_negative():
    import pandas as pd
    from cxrfl.data.site import SiteData

    a = SiteData(
        "a",
        ["x", "y"],
        pd.DataFrame(
            {"path": ["1", "2"], "patient": ["p", "q"], "split": ["train", "val"], "x": [1.0, np.nan], "y": [0.0, 1.0]}
        ),
    )
    b = SiteData(
        "b", ["y", "z"], pd.DataFrame({"path": ["3"], "patient": ["p"], "split": ["train"], "y": [1.0], "z": [1.0]})
    )
    pooled = pooled_site([a, b], selection="head")
    assert pooled.classes == ["x", "y", "z"]
    t = pooled.table
    assert t["z"].tolist()[:2] == [0.0, 0.0] and t["x"].tolist()[2] == 0.0  # missing = negative
    assert np.isnan(t["x"].tolist()[1])  # a label the site itself left unknown stays unknown
    assert t["patient"].nunique() == 3  # the same id at two sites is two patients
    # issue 41 point 4 (the default): trained as negatives, but a validation image counts only its own site's
    # classes in the loss that selects the model
    fair = pooled_site([a, b]).table
    assert fair["z"].tolist()[0] == 0.0 and np.isnan(fair["z"].tolist()[1]) and fair["x"].tolist()[2] == 0.0
    assert fair["y"].tolist() == [0.0, 1.0, 1.0]  # labels a site has are never touched


def markdown_table_after(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after ``heading`` (header row first, separator dropped)."""
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        if not line.startswith("|-"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_report_renders_from_results_alone(compare_run):
    res = json.loads((compare_run / "results.json").read_text())
    text = (compare_run / "report.md").read_text()
    assert format_report(res) == text
    # issue 44 point 3: the line above compares the formatter with itself; the table of mean AUROCs is read back
    # here and each cell checked against the results' numbers, under the right method and view
    header, *rows = markdown_table_after(text, "## Mean AUROC, all classes")
    views = [v for v, d in res["views"].items() if d["kind"] in ("site", "external")]
    assert header == ["method"] + [
        f"{v} ({'test split' if res['views'][v]['kind'] == 'site' else 'external'})" for v in views
    ]
    by_label = {r[0]: r[1:] for r in rows}
    assert set(by_label) == {m["label"] for m in res["methods"].values()}
    shown = set()
    for m in res["methods"].values():
        for v, cell in zip(views, by_label[m["label"]]):
            mean, sd = m["test"][v]["mean"], m["test"][v]["sd"]
            if mean is None:
                assert cell == "-", (m["label"], v)
            else:
                assert cell.startswith(f"{mean:.3f} ± {sd:.3f}"), (m["label"], v, cell)
                shown.add(f"{mean:.3f}")
    assert len(shown) > 1  # the numbers tell the cells apart


def test_pretrained_stand_in_loads_into_the_feature_extractor(tmp_path):
    import torch
    from cxrfl.bench.pretrain import pretrain_backbone
    from cxrfl.nn.models import ModelConfig, build_model, load_checkpoint

    ckpt = tmp_path / "pre.pt"
    summary = pretrain_backbone(
        ckpt,
        data_dir=tmp_path / "data",
        n_images=30,
        image_size=32,
        data_image_size=32,
        steps=2,
        batch_size=8,
        log=lambda _m: None,
    )
    assert summary["steps"] == 2 and ckpt.is_file()
    saved = load_checkpoint(ckpt)
    assert len(saved["classes"]) == 20
    model = build_model(ModelConfig(image_size=32, pretrained=str(ckpt)), 3)
    for k, v in model.backbone.state_dict().items():
        torch.testing.assert_close(v, saved["model"]["backbone." + k], msg=k)
