"""The installed ``cxrfl`` command's exit codes (issue 44 point 4): 0 done, 1 some input unreadable
(the rest still done), 2 refused with one ``cxrfl: error:`` line naming what to fix."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cxrfl.nn.models import ModelConfig, build_model, save_checkpoint
from PIL import Image

CLASSES = ["Atelectasis", "Edema"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    config = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here
    torch.manual_seed(0)
    model = build_model(config, len(CLASSES))
    save_checkpoint(root / "model.pt", model, classes=CLASSES, model_config=config)
    broken = {k: v.clone() for k, v in model.state_dict().items()}
    broken["classifier.bias"][0] = math.nan
    save_checkpoint(root / "nan.pt", broken, classes=CLASSES, model_config=config)
    Image.fromarray((np.random.default_rng(0).random((40, 40)) * 255).astype(np.uint8)).save(root / "x.png")
    (root / "site.yaml").write_text("site: s\ndataset:\n  format: nih\n")  # no label file
    (root / "notes.txt").write_text("not a checkpoint")
    return {"root": root, **{p.stem: p for p in root.iterdir()}}


def run(*args: str) -> subprocess.CompletedProcess:
    exe = str(Path(sys.executable).with_name("cxrfl"))
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def test_success_is_zero(files):
    proc = run("predict", "--model", str(files["model"]), str(files["x"]))
    assert proc.returncode == 0, proc.stderr
    assert "Atelectasis" in proc.stdout


def test_an_unreadable_image_is_one_and_the_others_are_still_predicted(files):
    proc = run("predict", "--csv", "--model", str(files["model"]), str(files["root"] / "missing.png"), str(files["x"]))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip().splitlines()[0]]
    assert "missing.png" in proc.stderr and str(files["x"]) in proc.stdout


@pytest.mark.parametrize(
    "args, names",
    [
        (("predict", "--model", "{root}/absent.pt", "{root}/x.png"), "absent.pt"),
        (("predict", "--model", "{root}/notes.txt", "{root}/x.png"), "notes.txt"),
        (("predict", "--model", "{root}/nan.pt", "{root}/x.png"), "nan.pt"),
        (("export", "bundle", "--model", "{root}/nan.pt", "--out", "{root}/bundle"), "nan.pt"),
        (("data", "summary", "{root}/site.yaml"), "site.yaml"),
    ],
)
def test_a_refusal_is_two_with_one_line_naming_the_file(files, args, names):
    proc = run(*(a.format(root=files["root"]) for a in args))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("cxrfl: error:") and names in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_usage_error_is_two():
    proc = run("predict", "--json")
    assert proc.returncode == 2 and "--model" in proc.stderr
