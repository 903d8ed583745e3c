"""The README's data workflow from a shell: synthesize the demo profile, summarise every site."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
from cxrfl.data.labels import CHEXPERT_CLASSES, KNOWN_CLASSES, NIH_CLASSES


def cxrfl(*args: str) -> subprocess.CompletedProcess:
    exe = str(Path(sys.executable).with_name("cxrfl"))
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)


NIH_SPELLING = {"Effusion": "Pleural Effusion", "Pleural_Thickening": "Pleural Thickening"}


def counts_in_label_file(root: Path, site: str) -> tuple[int, int, dict[str, int]]:
    """(images, patients, positives per class) of a synthesized site, read from its label file with pandas.

    Args:
        root: the folder ``cxrfl data synth`` wrote.
        site: hospital-a (NIH), hospital-b (CheXpert: frontal images; uncertain counts as negative) or external (CSV).
    """
    if site == "hospital-a":
        t = pd.read_csv(root / site / "Data_Entry_2017_v2020.csv")
        found = [NIH_SPELLING.get(f, f) for cell in t["Finding Labels"] for f in cell.split("|")]
        return len(t), t["Patient ID"].nunique(), {c: found.count(c) for c in NIH_CLASSES}
    if site == "hospital-b":
        t = pd.read_csv(root / site / "CheXpert-v1.0-small" / "train.csv", dtype=str, keep_default_na=False)
        t = t[t["Frontal/Lateral"] == "Frontal"]
        patients = t["Path"].str.split("/").str[2].nunique()
        return len(t), patients, {c: int((t[c] == "1.0").sum()) for c in CHEXPERT_CLASSES}
    t = pd.read_csv(root / site / "labels.csv")
    return len(t), t["patient_id"].nunique(), {c: int(t[c].sum()) for c in KNOWN_CLASSES}


def test_synth_then_summary_of_every_written_site(tmp_path):
    out = tmp_path / "demo"
    synth = cxrfl(
        "data", "synth", "--profile", "two-hospitals", "--out", str(out), "--n-per-site", "40", "--image-size", "64"
    )
    assert synth.returncode == 0, synth.stderr
    configs = sorted(out.glob("*.yaml"))
    assert [p.stem for p in configs] == ["external", "hospital-a", "hospital-b"]
    expected = {"hospital-a": set(NIH_CLASSES), "hospital-b": set(CHEXPERT_CLASSES), "external": set(KNOWN_CLASSES)}
    for config in configs:
        run = cxrfl("data", "summary", str(config), "--json")
        summary = json.loads(run.stdout)
        if config.stem == "external":  # test images only: a job refuses it and the summary says why (issue 40, 13)
            assert run.returncode == 2 and summary["refused"]
            assert run.stderr.strip() == f"cxrfl: error: {summary['refused']}"
            assert summary["splits"]["train"] == summary["splits"]["val"] == 0
        else:
            assert run.returncode == 0 and summary["refused"] is None, run.stderr
        assert set(summary["classes"]) == expected[config.stem]
        # issue 44 point 3: "patients <= images" and the keys of "positives" held for any counts; the counts are
        # compared with the label file as written, read here without cxrfl
        images, patients, positives = counts_in_label_file(out, config.stem)
        assert (summary["images"], summary["patients"]) == (images, patients) and 0 < patients < images
        assert summary["images"] == sum(summary["splits"].values())
        if config.stem == "hospital-a":  # NIH format: every image is frontal
            assert summary["images"] == 40
        assert summary["positives"] == positives and sum(positives.values()) > 0
        table = cxrfl("data", "summary", str(config))
        assert table.returncode == run.returncode and config.stem in table.stdout


def test_summary_of_a_broken_config_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("site: x\ndataset: {format: dicomdir, labels: l.csv, images: .}\n")
    run = cxrfl("data", "summary", str(bad))
    assert run.returncode == 2
    assert "dicomdir" in run.stderr and "Traceback" not in run.stderr
