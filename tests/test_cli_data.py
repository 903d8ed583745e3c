"""The README's data workflow from a shell: synthesize the demo profile, summarise every site."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cxrfl.data.labels import CHEXPERT_CLASSES, KNOWN_CLASSES, NIH_CLASSES


def cxrfl(*args: str) -> subprocess.CompletedProcess:
    exe = str(Path(sys.executable).with_name("cxrfl"))
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)


def test_synth_then_summary_of_every_written_site(tmp_path):
    out = tmp_path / "demo"
    synth = cxrfl("data", "synth", "--profile", "two-hospitals", "--out", str(out), "--n-per-site", "40", "--image-size", "64")
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
        assert summary["images"] == sum(summary["splits"].values())
        assert summary["images"] > 0
        if config.stem == "hospital-a":  # NIH format: every image is frontal
            assert summary["images"] == 40
        assert summary["patients"] <= summary["images"]
        assert set(summary["positives"]) == expected[config.stem]
        table = cxrfl("data", "summary", str(config))
        assert table.returncode == run.returncode and config.stem in table.stdout


def test_summary_of_a_broken_config_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("site: x\ndataset: {format: dicomdir, labels: l.csv, images: .}\n")
    run = cxrfl("data", "summary", str(bad))
    assert run.returncode == 2
    assert "dicomdir" in run.stderr and "Traceback" not in run.stderr
