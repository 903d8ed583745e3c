"""Issue 40, inputs a site or an operator must not trust: a deployed site without its own data config,
checkpoints with non-finite weights, label files whose image paths leave the image root, and a data
summary that agrees with what a job accepts."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from cxrfl.cli import main
from cxrfl.data.site import load_site
from cxrfl.errors import ConfigError, DataError
from cxrfl.fl.site_config import LOCAL_CONFIG_NAME, resolve_site_config
from cxrfl.nn.models import ModelConfig, build_model, save_checkpoint
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from PIL import Image


# ------------------------------------------------------------- point 5: no demo data outside the simulator
@pytest.fixture
def no_config_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """No site config anywhere; the demo generator replaced by one tiny demo site (the sites it was asked for)."""
    from cxrfl.synth import write_profile

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CXRFL_SITE_CONFIG", raising=False)
    monkeypatch.delenv("CXRFL_SITE_CONFIG_DIR", raising=False)
    asked: list[str] = []

    def demo(site: str) -> Path:
        asked.append(site)
        return write_profile("two-hospitals", tmp_path / "demo", n_per_site=24, image_size=32, sites=[site])[0]

    monkeypatch.setattr("cxrfl.synth.demo_site_config", demo)
    return asked


def kit(tmp_path: Path, name: str) -> Path:
    """A provisioned kit's layout: startup/ and local/, no cxrfl_site.yaml."""
    for sub in ("startup", "local"):
        (tmp_path / name / sub).mkdir(parents=True)
    (tmp_path / name / "startup" / "start.sh").write_text("#!/bin/sh\n")
    return tmp_path / name


def start_executor(workspace: Path, site: str, *, simulator: bool) -> object:
    """A surgical site executor after NVFlare's START_RUN in ``workspace`` (a simulated client or a kit)."""
    from cxrfl.fl.surgical import SurgicalExecutor

    class Workspace:
        def get_root_dir(self) -> str:
            return str(workspace)

        def get_site_config_dir(self) -> str:
            return str(workspace / "local")

    class Engine:
        def get_workspace(self) -> Workspace:
            return Workspace()

        def fire_event(self, *_: object) -> None:
            return None

    ctx = FLContext()
    ctx.get_identity_name = lambda default="": site
    ctx.get_engine = lambda: Engine()
    if simulator:  # what NVFlare's simulator client runner sets (sticky) for every context of the run
        ctx.set_prop(FLContextKey.SIMULATE_MODE, True, private=True, sticky=True)
    executor = SurgicalExecutor(device="cpu", num_workers=0, num_threads=1, analytic_sender_id="")
    executor.handle_event("_start_run", ctx)
    return executor


def test_a_deployed_kit_without_a_site_config_is_stopped_with_how_to_write_one(tmp_path, no_config_env):
    # issue 40 point 5: hospital-a (a name of poc/project.yml) silently trained on the demo data
    site = kit(tmp_path, "hospital-a")
    with pytest.raises(ConfigError) as exc:
        resolve_site_config("hospital-a", site / "local")
    message = str(exc.value)
    assert "\n" not in message and "cxrfl deploy site-config" in message and LOCAL_CONFIG_NAME in message
    executor = start_executor(site, "hospital-a", simulator=False)
    assert executor.data is None and executor.error == message
    assert no_config_env == []  # no demo data was made or read


def test_the_simulator_still_gets_the_demo_data(tmp_path, no_config_env):
    # issue 40 point 5: the README demo (nvflare simulator ... -n 2: site-1, site-2) keeps working
    path, how = resolve_site_config("site-1", simulator=True)
    assert how == "the embedded demo data" and path.is_file()
    executor = start_executor(tmp_path / "simulate_job" / "site-2", "site-2", simulator=True)
    assert executor.error is None and executor.data.site == "hospital-b" and len(executor.data.table) > 0
    assert no_config_env == ["site-1", "site-2"]
    with pytest.raises(ConfigError, match="no site config for 'mystery-hospital'"):
        resolve_site_config("mystery-hospital", simulator=True)  # not a demo name: still one clear line


# --------------------------------------------------------------- point 7: non-finite weights are refused
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_checkpoint_with_non_finite_weights_is_refused_by_predict_and_export(tmp_path, capsys, bad):
    # issue 40 point 7: cxrfl predict printed nan and exited 0; cxrfl export bundle wrote the bundle
    config = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here
    model = build_model(config, 2)
    with torch.no_grad():
        model.classifier.weight[1, 3] = bad
    ckpt = tmp_path / "model.pt"
    save_checkpoint(ckpt, model, classes=["Edema", "Mass"], model_config=config)
    image = tmp_path / "x.png"
    Image.fromarray(np.full((16, 16), 99, np.uint8)).save(image)

    assert main(["predict", "--model", str(ckpt), str(image), "--precision", "fp32"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert str(ckpt) in err and "classifier.weight" in err and "not finite" in err

    assert main(["export", "bundle", "--model", str(ckpt), "--out", str(tmp_path / "bundle")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "not finite" in err
    assert not (tmp_path / "bundle").exists()


# ------------------------------------------------------------- point 10: image paths stay under the root
def png(path: Path, value: int = 128) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((16, 16), value, np.uint8)).save(path)
    return path


@pytest.fixture
def escaping_site(tmp_path: Path) -> dict[str, object]:
    """A generic-CSV site whose label file names 12 images under images/ and three outside it:
    an absolute path, a ``..`` path and a symlink under images/ that points outside."""
    root = tmp_path / "site"
    secrets = [png(tmp_path / "elsewhere" / f"secret{k}.png", k) for k in range(3)]
    lines = ["file,Edema"]
    lines += [f"{png(root / 'images' / f'{i:02d}.png', i).name},{i % 2}" for i in range(12)]
    (root / "images" / "link.png").symlink_to(secrets[2])
    escaping = {14: str(secrets[0]), 15: "../../elsewhere/secret1.png", 16: "link.png"}  # file line -> as written
    lines += [f"{p},1" for p in escaping.values()]
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return {"root": root, "escaping": escaping, "secrets": {os.path.realpath(p) for p in secrets}}


def site_yaml(root: Path, labels: str = "labels.csv", **changes: object) -> Path:
    data = {
        "site": "hospital-x",
        "dataset": {
            "format": "csv",
            "labels": labels,
            "images": "images",
            "path_column": "file",
            **changes.pop("dataset", {}),
        },
        **changes,
    }
    path = root / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_image_paths_that_leave_the_image_root_are_refused_one_line_each(escaping_site):
    # issue 40 point 10: absolute paths, '..' and symlinks in a label file were followed out of dataset.images
    root = escaping_site["root"]
    site = load_site(site_yaml(root))
    used = {os.path.realpath(p) for p in site.table["path"]}
    assert len(site.table) == 12 and not used & escaping_site["secrets"]
    assert all(Path(p).is_relative_to(os.path.realpath(root / "images")) for p in used)
    refused = [p for p in site.problems if "outside dataset.images" in p]
    assert len(refused) == 3
    for line, written in escaping_site["escaping"].items():
        (problem,) = [p for p in refused if f"line {line}:" in p]
        assert repr(written) in problem and "allow_outside_images" in problem and "\n" not in problem


def test_images_outside_the_root_are_read_when_the_site_config_allows_it(escaping_site):
    # issue 40 point 10: the explicit opt-in
    site = load_site(site_yaml(escaping_site["root"], dataset={"allow_outside_images": True}))
    assert len(site.table) == 15 and not [p for p in site.problems if "outside dataset.images" in p]
    assert escaping_site["secrets"] <= {os.path.realpath(p) for p in site.table["path"]}


def test_a_label_file_whose_every_image_leaves_the_root_is_one_error(escaping_site):
    # issue 40 point 10: nothing left to read
    root = escaping_site["root"]
    (root / "outside.csv").write_text("file,Edema\n../../elsewhere/secret1.png,1\nlink.png,0\n")
    with pytest.raises(DataError) as exc:
        load_site(site_yaml(root, labels="outside.csv"))
    assert "\n" not in str(exc.value) and "outside dataset.images" in str(exc.value)
    with pytest.raises(ConfigError, match="allow_outside_images must be"):
        load_site(site_yaml(root, dataset={"allow_outside_images": "yes please"}))


def test_an_nih_image_index_with_dotdot_is_refused(escaping_site):
    # issue 40 point 10: every reader, here NIH's 'Image Index'
    root = escaping_site["root"]
    rows = [f"{i:02d}.png,Edema,p{i},PA" for i in range(12)] + ["../../elsewhere/secret1.png,Edema,p99,PA"]
    (root / "nih.csv").write_text("Image Index,Finding Labels,Patient ID,View Position\n" + "\n".join(rows) + "\n")
    path = root / "nih.yaml"
    path.write_text(
        yaml.safe_dump({"site": "h", "dataset": {"format": "nih", "labels": "nih.csv", "images": "images"}})
    )
    site = load_site(path, check_images=False)
    assert len(site.table) == 12
    assert [p for p in site.problems if "line 14:" in p and "outside dataset.images" in p]


# ------------------------------------------------ point 13: the summary refuses what the job refuses
def test_summary_of_a_config_with_an_empty_validation_split_fails_like_the_job(escaping_site, capsys, monkeypatch):
    # issue 40 point 13: cxrfl data summary exited 0 for a site the job refuses at start-up
    config = site_yaml(escaping_site["root"], split={"train": 0.8, "val": 0.0, "test": 0.2})
    assert main(["data", "summary", str(config), "--no-image-check"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "empty train or val split" in err

    monkeypatch.setenv("CXRFL_SITE_CONFIG", str(config))
    executor = start_executor(escaping_site["root"], "hospital-x", simulator=False)
    assert executor.error and err == f"cxrfl: error: {executor.error}"
