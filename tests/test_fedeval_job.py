"""End to end: the evaluation-only job (job_recipes/fedeval/job.py) exported with a model it did not
train, run in NVFlare's simulator on two demo hospitals with different label sets (issue 45 point 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TINY_MODEL, names_in, nvflare_bin
from cxrfl.data.labels import CHEXPERT_CLASSES, KNOWN_CLASSES, NIH_CLASSES
from cxrfl.nn.models import ModelConfig, build_model, load_checkpoint, save_checkpoint
from cxrfl.synth import write_profile

pytestmark = pytest.mark.slow

SITES = ("hospital-a", "hospital-b")  # NIH labels at a, CheXpert labels at b


@pytest.fixture(scope="module")
def simulated(tmp_path_factory, repo_root):
    tmp = tmp_path_factory.mktemp("fedeval_sim")
    write_profile("two-hospitals", tmp / "data", n_per_site=80, image_size=32, sites=list(SITES))
    torch.manual_seed(0)
    config = ModelConfig(**TINY_MODEL)
    model = tmp / "external_model.pt"  # a model no job of this federation trained
    save_checkpoint(model, build_model(config, len(KNOWN_CLASSES)), classes=list(KNOWN_CLASSES), model_config=config)
    env = {**os.environ, "CXRFL_SITE_CONFIG_DIR": str(tmp / "data"), "HOME": str(tmp / "home")}
    export = subprocess.run(
        [
            sys.executable,
            str(repo_root / "job_recipes" / "fedeval" / "job.py"),
            "--model",
            str(model),
            "--clients",
            ",".join(SITES),
            "--min_cell",
            "1",
            "--split",  # on validation, fitting maps and points: every task of the job, each site's copy too
            "val",
            "--calibration",
            "platt",
            "--target",
            "youden",
            "--export",
            "--export-dir",
            str(tmp / "jobs"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert export.returncode == 0, export.stderr[-3000:]
    job, ws = tmp / "jobs" / "fedeval", tmp / "ws"
    proc = subprocess.run(
        [
            nvflare_bin(),
            "simulator",
            str(job),
            "-w",
            str(ws),
            "-c",
            ",".join(SITES),
            "-t",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = ws / "server" / "simulate_job" / "app_server" / "cxrfl" / "evaluation.json"
    if not report.is_file():
        pytest.fail(f"no evaluation written (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return {"job": job, "ws": ws, "report": json.loads(report.read_text())}


def test_each_class_is_pooled_over_exactly_the_sites_that_label_it(simulated):
    classes = simulated["report"]["classes"]
    assert list(classes) == list(KNOWN_CLASSES)
    for c, entry in classes.items():
        labelling = sorted(s for s, own in zip(SITES, (NIH_CLASSES, CHEXPERT_CLASSES)) if c in own)
        assert entry["sites_labelling"] == labelling, c
        if entry["auroc"] is not None:
            assert set(entry["sites_pooled"]) <= set(labelling) and entry["sites_pooled"]
            assert 0 <= entry["auroc"]["low"] <= entry["auroc"]["value"] <= entry["auroc"]["high"] <= 1
    shared = sorted(set(NIH_CLASSES) & set(CHEXPERT_CLASSES))
    assert any(classes[c]["sites_pooled"] == list(SITES) for c in shared)  # a shared class pooled over both


def test_the_model_and_other_sites_class_names_reach_no_site(simulated):
    for site, foreign in (
        ("hospital-a", set(CHEXPERT_CLASSES) - set(NIH_CLASSES)),
        ("hospital-b", set(NIH_CLASSES) - set(CHEXPERT_CLASSES)),
    ):
        assert not list((simulated["job"]).glob(f"app_{site}/**/external_model.pt"))
        root = simulated["ws"] / site
        files = [p for p in root.rglob("*") if p.is_file()]
        assert any(p.name == "log.txt" for p in files) and not [p for p in files if p.name == "external_model.pt"]
        leaks = {str(p.relative_to(root)): names_in(p, sorted(foreign)) for p in files}
        assert {p: n for p, n in leaks.items() if n} == {}, site
        own = list(root.rglob("cxrfl_state/site_models/*.pt"))  # the site's calibrated copy, scanned above
        assert len(own) == 1 and own[0].stat().st_mode & 0o777 == 0o600, own
        copy = load_checkpoint(own[0])
        assert set(copy["classes"]) == set(NIH_CLASSES if site == "hospital-a" else CHEXPERT_CLASSES)
        assert copy["clinical"]["operating_points"] and set(copy["clinical"]["operating_points"]) <= set(
            copy["classes"]
        )
        server = simulated["ws"] / "server" / "simulate_job" / "app_server" / "cxrfl" / "evaluation.json"
        assert names_in(server, sorted(foreign))  # positive control: the scan finds the names where they are
