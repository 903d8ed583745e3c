"""End to end: the README's demo command (``nvflare simulator -n 2``, whose sites fall back to the embedded
demo hospitals, then ``cxrfl report --external demo``) on the exported surgical job made small and a small
demo (the session's ``surgical_sim`` run, which ``tests/test_recipes_sim.py`` also reads)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import DEMO, DEMO_IMAGES, names_in
from cxrfl.common.io import read_records
from cxrfl.data.labels import CHEXPERT_CLASSES, KNOWN_CLASSES, NIH_CLASSES, NIH_COLUMN_NAMES
from cxrfl.nn.models import load_checkpoint
from sklearn.metrics import roc_auc_score

pytestmark = pytest.mark.slow

NIH_ONLY = sorted(set(NIH_CLASSES) - set(CHEXPERT_CLASSES))
CHEXPERT_ONLY = sorted(set(CHEXPERT_CLASSES) - set(NIH_CLASSES))


def selected_round(records: list[dict], min_delta: float) -> int:
    """The round whose model has the lowest mean validation loss, by the job's rule (an improvement
    must exceed ``min_delta``), from the scores the records hold."""
    best, chosen = float("inf"), None
    for r in records:
        if r.get("evaluated_round") is not None and r["mean_val_loss"] < best - min_delta:
            best, chosen = r["mean_val_loss"], r["evaluated_round"]
    return chosen


def test_global_model_names_the_union(surgical_sim):
    rounds = surgical_sim["args"]["num_rounds"]
    ckpt = load_checkpoint(surgical_sim["app"] / "FL_global_model.pt")
    assert ckpt["classes"] == list(KNOWN_CLASSES)
    assert ckpt["model"]["classifier.weight"].shape[0] == 20
    assert ckpt["round"] == rounds
    last = load_checkpoint(surgical_sim["app"] / "cxrfl" / "checkpoints" / f"round_{rounds:03d}.pt")
    for k, v in last["model"].items():
        torch.testing.assert_close(ckpt["model"][k], v, rtol=0, atol=0, msg=k)


def test_the_selected_model_is_the_round_with_the_lowest_validation_loss(surgical_sim):
    rounds = surgical_sim["args"]["num_rounds"]
    records = read_records(surgical_sim["app"] / "cxrfl" / "rounds.jsonl")
    scored = [(r["evaluated_round"], r["phase"]) for r in records if r.get("evaluated_round") is not None]
    assert scored == [*((r, "train") for r in range(rounds)), (rounds, "validate")]  # the last by a validate task
    for r in records:
        if r.get("evaluated_round") is not None:
            losses = [m["val_loss"] if r["phase"] == "train" else m["loss"] for m in r["site_metrics"].values()]
            assert r["mean_val_loss"] == pytest.approx(sum(losses) / 2)
    chosen = selected_round(records, surgical_sim["args"]["min_delta"])
    best = load_checkpoint(surgical_sim["app"] / "best_FL_global_model.pt")
    assert best["round"] == chosen and best["classes"] == list(KNOWN_CLASSES)
    if chosen > 0:
        saved = load_checkpoint(surgical_sim["app"] / "cxrfl" / "checkpoints" / f"round_{chosen:03d}.pt")
        for k, v in saved["model"].items():
            torch.testing.assert_close(best["model"][k], v, rtol=0, atol=0, msg=k)
    else:  # the warmed-up model: not the model of round 1
        first = load_checkpoint(surgical_sim["app"] / "cxrfl" / "checkpoints" / "round_001.pt")
        assert any(not torch.equal(best["model"][k], v) for k, v in first["model"].items())
    ev = json.loads((surgical_sim["app"] / "cxrfl" / "evaluation.json").read_text())
    assert ev["best_round"] == chosen


def test_aggregation_record_lists_exact_contributors(surgical_sim):
    records = [
        r for r in read_records(surgical_sim["app"] / "cxrfl" / "rounds.jsonl") if r["phase"] in ("warmup", "train")
    ]
    assert [r["round"] for r in records] == list(range(surgical_sim["args"]["num_rounds"] + 1))
    for r in records:
        assert r["aggregated"], r
        assert r["sites_aggregated"] == ["site-1", "site-2"]
        contributors = r["contributors"]
        assert set(contributors) == set(KNOWN_CLASSES)
        for c in KNOWN_CLASSES:
            expected = sorted(s for s, cls in (("site-1", NIH_CLASSES), ("site-2", CHEXPERT_CLASSES)) if c in cls)
            assert contributors[c] == expected, c
        own = {"site-1": NIH_CLASSES, "site-2": CHEXPERT_CLASSES}
        for site, m in r["site_metrics"].items():
            assert set(m["val_auroc"]) == set(own[site]), site  # a site scores its own classes only
            defined = [v for v in m["val_auroc"].values() if v is not None]
            assert m["val_mean_auroc"] == pytest.approx(sum(defined) / len(defined))
        if r["phase"] == "train":  # model selection reads the sites' mean validation loss
            losses = [m["val_loss"] for m in r["site_metrics"].values()]
            assert r["mean_val_loss"] == pytest.approx(sum(losses) / len(losses))


def test_evaluation_written_for_both_sites(surgical_sim):
    ev = json.loads((surgical_sim["app"] / "cxrfl" / "evaluation.json").read_text())
    assert set(ev["sites"]) == {"site-1", "site-2"}
    assert ev["classes"] == list(KNOWN_CLASSES)
    assert ev["shared_classes"] == sorted(set(NIH_CLASSES) & set(CHEXPERT_CLASSES))
    for site, classes in (("site-1", NIH_CLASSES), ("site-2", CHEXPERT_CLASSES)):
        m = ev["sites"][site]
        assert m["split"] == "test" and m["loss"] > 0 and m["n"] > 0
        assert set(m["auroc"]) == set(classes)
        defined = [v for v in m["auroc"].values() if v is not None]
        shared = [m["auroc"][c] for c in ev["shared_classes"] if m["auroc"][c] is not None]
        for got, values in ((m["mean"], defined), (m["shared"]["mean"], shared)):  # None: no class with both labels
            assert got == (pytest.approx(sum(values) / len(values)) if values else None)
    assert ev["external"] is None  # the demo job names no external test set


def test_the_leak_scan_finds_whole_words_in_either_spelling(tmp_path):
    # names that start at the same place, one inside another, a longer word, a plural: one search finds each
    (tmp_path / "log.txt").write_bytes(b"x Pleural_Thickening; Massive Edemas Mass")
    names = ["Pleural", "Pleural Thickening", "Thickening", "Mass", "Edema"]
    assert names_in(tmp_path / "log.txt", names) == ["Pleural", "Pleural_Thickening", "Thickening", "Mass"]


@pytest.mark.parametrize("site,foreign", [("site-2", NIH_ONLY), ("site-1", CHEXPERT_ONLY)])
def test_no_site_file_names_the_other_sites_classes(surgical_sim, site, foreign, tmp_path):
    root = surgical_sim["ws"] / site
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "log.txt" for p in files)
    foreign_names = foreign + [k for k, v in NIH_COLUMN_NAMES.items() if v in foreign]
    leaks = {str(p.relative_to(root)): names_in(p, foreign_names) for p in files}
    assert {p: n for p, n in leaks.items() if n} == {}
    # positive controls: the same scan finds the site's own classes in its log, and a foreign name
    # planted in a torch file (the site's state format) and in a copy of its log
    own = CHEXPERT_ONLY if site == "site-2" else NIH_ONLY
    assert any(names_in(p, own) for p in files if p.name == "log.txt")
    torch.save({"classes": [foreign[0]], "w": torch.zeros(3)}, tmp_path / "planted.pt")
    log = next(p for p in files if p.name == "log.txt")
    (tmp_path / "log.txt").write_bytes(log.read_bytes() + f"... {foreign[-1]} ...".encode())
    assert foreign[0] in names_in(tmp_path / "planted.pt", foreign_names)
    assert foreign[-1] in names_in(tmp_path / "log.txt", foreign_names)


def _printed_mean(stdout: str, first_word: str) -> float:
    """The mean test AUROC ``cxrfl report`` printed on the line that starts with ``first_word``."""
    line = next(x for x in stdout.splitlines() if x.split()[:1] == [first_word])
    return float(re.search(r"mean (\d\.\d{3})", line).group(1))


def test_the_readme_demo_command_trains_on_the_demo_data_and_reports_every_test_set(surgical_sim, demo_env):
    assert surgical_sim["rc"] == 0, surgical_sim["output"]
    out, app = surgical_sim["stdout"], surgical_sim["app"]
    for site in DEMO:  # -n 2: the simulator's site-1 and site-2 found no site config and read the demo data
        log = "".join(p.read_text() for p in (surgical_sim["ws"] / site).rglob("log.txt"))
        assert re.search(rf"site {site}: reading site config \S+\.yaml \(from the embedded demo data\)", log), site
    ev = json.loads((app / "cxrfl" / "evaluation.json").read_text())
    for site in DEMO:
        assert _printed_mean(out, site) == pytest.approx(ev["sites"][site]["mean"], abs=5e-4)
    # --external demo: the demo's external set (DEMO_IMAGES images, 20 classes), its mean AUROC computed here
    # from `cxrfl predict`'s probabilities and the set's label file
    (config,) = Path(demo_env["CXRFL_DEMO_DIR"]).glob(f"two-hospitals-n{DEMO_IMAGES}-*/external.yaml")
    labels = pd.read_csv(config.parent / "external" / "labels.csv")
    images = [str(config.parent / "external" / p) for p in labels["path"]]
    cxrfl = str(Path(sys.executable).with_name("cxrfl"))
    predicted = subprocess.run(
        [cxrfl, "predict", "--model", str(app / "best_FL_global_model.pt"), "--json", *images],
        capture_output=True,
        text=True,
        check=True,
    )
    probs = pd.DataFrame([r["probabilities"] for r in json.loads(predicted.stdout)])
    aurocs = [roc_auc_score(labels[c], probs[c]) for c in KNOWN_CLASSES if labels[c].nunique() == 2]
    assert len(labels) == DEMO_IMAGES and len(aurocs) >= 15
    line = next(x for x in out.splitlines() if x.split()[:1] == ["external"])
    assert f"({DEMO_IMAGES} images)" in line
    assert _printed_mean(out, "external") == pytest.approx(sum(aurocs) / len(aurocs), abs=2e-3)
