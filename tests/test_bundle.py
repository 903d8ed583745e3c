"""``cxrfl export bundle``: a MONAI bundle of a trained model that MONAI's own ConfigParser and
``python -m monai.bundle run`` load, predicting what ``cxrfl predict --precision fp32`` predicts."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cxrfl.cli import main
from cxrfl.errors import ConfigError
from cxrfl.nn.models import ModelConfig, build_model, save_checkpoint
from cxrfl.predict import predict_images
from PIL import Image
from pydicom.data import get_testdata_file
from pydicom.dataset import FileDataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

CLASSES = ["Atelectasis", "Edema", "Pneumonia"]
CONFIG = ModelConfig(arch="densenet-tiny", image_size=32)  # the bundle is the subject, not the network
PRODUCT = ModelConfig(image_size=32)  # DenseNet121, the product's network: one end-to-end `monai.bundle run`


def write_dicom(path: Path, pixels: np.ndarray) -> Path:
    """A 16-bit MONOCHROME2 DX image with a window (cxrfl applies it)."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.1.1"
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID, ds.Modality = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID, "DX"
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    ds.WindowCenter, ds.WindowWidth = 1800, 2400
    ds.PixelData = pixels.astype(np.uint16).tobytes()
    ds.save_as(path, enforce_file_format=True)
    return path


def export_trained(tmp: Path, config: ModelConfig) -> dict:
    """A model of ``config`` trained a few steps (BatchNorm statistics moved too), saved as a run's best
    model with the run's records beside it and exported as a bundle, and a folder of PNG and DICOM images."""
    torch.manual_seed(0)
    model = build_model(config, len(CLASSES))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(3):
        x = torch.randn(8, config.in_channels, config.image_size, config.image_size)
        y = torch.randint(0, 2, (8, len(CLASSES))).float()
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        opt.step()
    app = tmp / "app_server"
    save_checkpoint(app / "best_FL_global_model.pt", model, classes=CLASSES, model_config=config, extra={"round": 3})
    (app / "cxrfl").mkdir()
    (app / "cxrfl" / "run_config.json").write_text(json.dumps({"num_rounds": 7, "head_mode": "surgical"}))
    (app / "cxrfl" / "evaluation.json").write_text(
        json.dumps(
            {
                "best_round": 3,
                "sites": {
                    "hospital-a": {"auroc": {"Atelectasis": 0.8, "Edema": 0.6}, "mean_auroc": 0.7},
                    "hospital-b": {"auroc": {"Atelectasis": 0.6, "Edema": None, "Pneumonia": 0.9}, "mean_auroc": 0.75},
                },
            }
        )
    )
    images = tmp / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    gray = (rng.random((48, 40)) * 255).astype(np.uint8)
    Image.fromarray(gray).save(images / "a.png")
    Image.fromarray(np.stack([gray, gray[::-1], gray[:, ::-1]], -1)).save(images / "b_rgb.png")
    write_dicom(images / "c.dcm", (rng.random((40, 36)) * 4000).astype(np.uint16))
    (images / "d_ct.dcm").write_bytes(Path(get_testdata_file("CT_small.dcm")).read_bytes())  # a real DICOM
    (images / "notes.txt").write_text("not an image: left out")
    bundle = tmp / "bundle"
    assert (
        main(
            [
                "export",
                "bundle",
                "--model",
                str(app / "best_FL_global_model.pt"),
                "--out",
                str(bundle),
                "--name",
                "tiny-cxr",
            ]
        )
        == 0
    )
    expected = {
        Path(r["image"]).name: r["probabilities"]
        for r in predict_images(
            app / "best_FL_global_model.pt",
            [p for p in sorted(images.iterdir()) if p.suffix != ".txt"],
            precision="fp32",
        )
    }
    return {"tmp": tmp, "app": app, "images": images, "bundle": bundle, "expected": expected, "model": model}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return export_trained(tmp_path_factory.mktemp("bundle"), CONFIG)


@pytest.fixture(scope="module")
def trained_densenet121(tmp_path_factory):
    return export_trained(tmp_path_factory.mktemp("bundle121"), PRODUCT)


def test_the_bundle_has_monais_layout_and_names_the_classes_in_order(trained):
    bundle = trained["bundle"]
    assert {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file()} == {
        "configs/metadata.json",
        "configs/inference.json",
        "models/model.pt",
        "docs/README.md",
    }
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    pred = meta["network_data_format"]["outputs"]["pred"]
    assert pred["channel_def"] == {"0": "Atelectasis", "1": "Edema", "2": "Pneumonia"} and pred["num_channels"] == 3
    assert pred["type"] == "probabilities" and meta["name"] == "tiny-cxr"
    assert meta["network_data_format"]["inputs"]["image"]["spatial_shape"] == [32, 32]
    state = torch.load(bundle / "models" / "model.pt", weights_only=True)
    for k, v in trained["model"].state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=k)
    assert meta["eval_metrics"]["mean_test_auroc"] == pytest.approx(0.725)


def test_the_model_card_carries_the_runs_settings_and_evaluation(trained):
    card = (trained["bundle"] / "docs" / "README.md").read_text()
    assert '"num_rounds": 7' in card and "round 3" in card
    assert "mean AUROC 0.725 ± 0.025" in card  # the mean and SD of the sites' means
    for c, v in (("Atelectasis", 0.7), ("Edema", 0.6), ("Pneumonia", 0.9)):  # over the sites that label the class
        assert f"| {c} | {v:.3f} |" in card
    assert "hospital" not in card  # no site is named in a card that travels to every site


def test_monais_config_parser_builds_network_and_preprocessing_that_match_cxrfl_predict(trained):
    from monai.bundle import ConfigParser

    bundle = trained["bundle"]
    parser = ConfigParser()
    parser.read_config(bundle / "configs" / "inference.json")
    parser.read_meta(bundle / "configs" / "metadata.json")
    parser["bundle_root"] = str(bundle)
    parser["device"] = "$torch.device('cpu')"
    network = parser.get_parsed_content("network_def")
    network.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True))
    network.eval()
    preprocessing = parser.get_parsed_content("preprocessing")
    postprocessing = parser.get_parsed_content("postprocessing")
    channels = parser.get_parsed_content("_meta_#network_data_format#outputs#pred#channel_def")
    for name, expected in trained["expected"].items():
        x = preprocessing({"image": str(trained["images"] / name)})["image"]
        with torch.no_grad():
            probs = postprocessing(network(x.unsqueeze(0)))[0]
        got = {channels[str(i)]: float(p) for i, p in enumerate(probs)}
        assert got == pytest.approx(expected, abs=1e-4), name


def test_monai_bundle_run_predicts_a_folder_of_png_and_dicom_like_cxrfl_predict(trained_densenet121, tmp_path):
    trained = trained_densenet121  # the product's network through MONAI (the other tests: densenet-tiny)
    meta = json.loads((trained["bundle"] / "configs" / "metadata.json").read_text())
    assert meta["description"].startswith("densenet121 ")
    rows = run_bundle(trained["bundle"], trained["images"], tmp_path / "out")
    assert [Path(r[0]).name for r in rows] == sorted(trained["expected"])  # PNG and DICOM; the .txt left out
    for row in rows:
        expected = trained["expected"][Path(row[0]).name]
        assert [float(v) for v in row[1:]] == pytest.approx([expected[c] for c in CLASSES], abs=1e-4), row[0]


def run_bundle(bundle: Path, images: Path, out: Path) -> list[list[str]]:
    """``python -m monai.bundle run`` over a folder; the rows of predictions.csv."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "monai.bundle",
            "run",
            "--config_file",
            str(bundle / "configs" / "inference.json"),
            "--bundle_root",
            str(bundle),
            "--dataset_dir",
            str(images),
            "--output_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(csv.reader((out / "predictions.csv").read_text().splitlines()))


def test_a_calibrated_model_predicts_and_bundles_calibrated_probabilities_and_decisions(trained, tmp_path):
    # issue 45 points 2-3: the calibration map and operating points travel in the checkpoint and the bundle
    clinical = {
        "calibration": {
            "Atelectasis": {"kind": "platt", "slope": 0.5, "intercept": -1.0},
            "Pneumonia": {"kind": "temperature", "slope": 2.0, "intercept": 0.0},
        },
        "operating_points": {
            "Edema": {
                "threshold": 0.5,
                "calibrated_threshold": 0.5,
                "target": "youden",
                "value": None,
                "met": True,
                "sensitivity": 0.8,
                "specificity": 0.7,
            }
        },
        "fitted_on": {"split": "val", "classes": {"Atelectasis": {"positives": 30, "negatives": 70, "sites": 2}}},
    }
    model = tmp_path / "calibrated.pt"
    save_checkpoint(model, trained["model"], classes=CLASSES, model_config=CONFIG, extra={"clinical": clinical})
    images = [p for p in sorted(trained["images"].iterdir()) if p.suffix != ".txt"]
    raw = predict_images(model, images, precision="fp32", raw=True)
    shown = predict_images(model, images, precision="fp32")
    for r, s in zip(raw, shown, strict=True):
        z = {c: np.log(r["probabilities"][c] / (1 - r["probabilities"][c])) for c in CLASSES}
        assert s["probabilities"]["Atelectasis"] == pytest.approx(
            1 / (1 + np.exp(-(0.5 * z["Atelectasis"] - 1))), abs=1e-5
        )
        assert s["probabilities"]["Pneumonia"] == pytest.approx(1 / (1 + np.exp(-2 * z["Pneumonia"])), abs=1e-5)
        assert s["probabilities"]["Edema"] == pytest.approx(r["probabilities"]["Edema"], abs=1e-7)  # no map: raw
        assert s["positive"] == {"Edema": r["probabilities"]["Edema"] >= 0.5}
    assert main(["export", "bundle", "--model", str(model), "--out", str(tmp_path / "bundle")]) == 0
    rows = run_bundle(tmp_path / "bundle", trained["images"], tmp_path / "out")
    expected = {Path(s["image"]).name: s["probabilities"] for s in shown}
    for row in rows:
        assert [float(v) for v in row[1:]] == pytest.approx([expected[Path(row[0]).name][c] for c in CLASSES], abs=1e-4)
    card = (tmp_path / "bundle" / "docs" / "README.md").read_text()
    assert "## Calibration and operating points" in card and "| Edema | none | 0.5000 / 0.5000 | youden |" in card
    meta = json.loads((tmp_path / "bundle" / "configs" / "metadata.json").read_text())
    assert meta["cxrfl_clinical"]["calibration"]["Pneumonia"]["slope"] == 2.0


def test_a_fedfew_model_is_refused_with_the_reason(tmp_path):
    path = tmp_path / "fedfew.pt"
    save_checkpoint(
        path,
        build_model(CONFIG, 2),
        classes=["A", "no CC"],
        model_config=CONFIG,
        extra={"fedfew": {"cc_classes": ["A"]}},
    )
    with pytest.raises(ConfigError, match="FedFew model"):
        from cxrfl.bundle import export_bundle

        export_bundle(path, tmp_path / "b")


def test_a_checkpoint_without_run_records_says_so_in_its_card(tmp_path):
    from cxrfl.bundle import export_bundle

    path = tmp_path / "alone.pt"
    save_checkpoint(path, build_model(CONFIG, 1), classes=["Edema"], model_config=CONFIG)
    card = (export_bundle(path, tmp_path / "b") / "docs" / "README.md").read_text()
    assert "settings are unknown" in card and "No evaluation was found" in card
