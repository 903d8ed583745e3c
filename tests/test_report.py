"""`cxrfl report`: what a person reads after a run, from the server's records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cxrfl.report import external_parts, format_report, learning_curve, load_run, sparkline, write_plots


def _run_folder(tmp_path: Path) -> Path:
    app = tmp_path / "ws" / "server" / "simulate_job" / "app_server"
    (app / "cxrfl").mkdir(parents=True)
    rounds = [
        {"round": 0, "phase": "warmup", "aggregated": True},
        {
            "round": 1,
            "phase": "train",
            "aggregated": True,
            "evaluated_round": 0,
            "mean_val_loss": 0.40,
            "mean_val_auroc": 0.60,
        },
        {
            "round": 2,
            "phase": "train",
            "aggregated": False,
            "evaluated_round": 1,
            "mean_val_loss": 0.99,
        },  # a failed attempt
        {
            "round": 2,
            "phase": "train",
            "aggregated": True,
            "evaluated_round": 1,
            "mean_val_loss": 0.30,
            "mean_val_auroc": 0.70,
        },
        {
            "round": 3,
            "phase": "train",
            "aggregated": True,
            "evaluated_round": 2,
            "mean_val_loss": 0.35,
            "mean_val_auroc": 0.68,
        },
        {"round": 3, "phase": "validate", "evaluated_round": 3, "mean_val_loss": 0.36, "mean_val_auroc": 0.67},
    ]
    (app / "cxrfl" / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    evaluation = {
        "classes": ["A", "B", "C"],
        "shared_classes": ["A"],
        "best_round": 1,
        "sites": {
            "h1": {
                "auroc": {"A": 0.8, "B": 0.6},
                "mean": 0.7,
                "sd": 0.14,
                "shared": {"mean": 0.8},
                "unique": {"mean": 0.6},
            },
            "h2": {
                "auroc": {"A": 0.9, "C": 0.7},
                "mean": 0.8,
                "sd": 0.14,
                "shared": {"mean": 0.9},
                "unique": {"mean": 0.7},
            },
        },
        "external": None,
    }
    (app / "cxrfl" / "evaluation.json").write_text(json.dumps(evaluation))
    return tmp_path / "ws"


def test_learning_curve_keeps_one_point_per_scored_model_from_aggregated_rounds(tmp_path):
    run = load_run(_run_folder(tmp_path))
    curve = learning_curve(run["rounds"])
    assert [(p["model"], p["loss"], p["auroc"]) for p in curve] == [
        (0, 0.40, 0.60),
        (1, 0.30, 0.70),
        (2, 0.35, 0.68),
        (3, 0.36, 0.67),
    ]


def test_sparkline_maps_lowest_and_highest_to_the_ends():
    assert sparkline([0.4, 0.3, 0.36]) == "█▁▅"
    assert sparkline([1.0, float("nan"), 1.0]) == "▁ ▁"
    assert sparkline([]) == ""


def test_external_set_is_summarised_by_shared_and_each_sites_unique_classes():
    parts = external_parts(
        {"auroc": {"A": 0.9, "B": 0.5, "C": 0.7, "D": None}}, {"h1": ["A", "B"], "h2": ["A", "C"]}, ["A"]
    )
    assert parts["all"]["mean"] == pytest.approx((0.9 + 0.5 + 0.7) / 3)
    assert parts["shared"]["mean"] == pytest.approx(0.9)
    assert parts["h1 only"]["mean"] == pytest.approx(0.5)
    assert parts["h2 only"]["mean"] == pytest.approx(0.7)


def test_report_tells_the_curve_the_stop_the_aurocs_the_files_and_the_next_commands(tmp_path):
    ws = _run_folder(tmp_path)
    run = load_run(ws)
    external = {"site": "ext", "images": 40, "auroc": {"A": 0.9, "B": 0.5, "C": 0.7}}
    text = format_report(run, external, workspace=ws, example_image="x.png")
    assert "did not improve in the last 2 scored model(s)" in text and "selected model: round 1" in text
    assert "  loss    0.400  0.300  0.350  0.360" in text
    assert "h1             mean 0.700 ± 0.140   shared 0.800   unique 0.600" in text
    assert (
        "external ext: mean 0.700" in text
        and "shared 0.900" in text
        and "h1 only 0.500" in text
        and "(40 images)" in text
    )
    assert str(run["app"] / "best_FL_global_model.pt") in text
    assert "predict --model" in text and "x.png" in text and f"--plots {ws / 'plots'}" in text


def test_plots_are_written(tmp_path):
    ws = _run_folder(tmp_path)
    written = write_plots(load_run(ws), tmp_path / "plots", {"site": "ext", "auroc": {"A": 0.9}})
    assert [p.name for p in written] == ["learning_curve.png", "auroc_per_class.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_cli_report_names_a_missing_run_in_one_line(tmp_path):
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("cxrfl")), "report", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "no cxrfl server output" in proc.stderr and "Traceback" not in proc.stderr
