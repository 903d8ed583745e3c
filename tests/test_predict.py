"""`cxrfl predict` on PNG and DICOM images with a self-describing checkpoint."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cxrfl.cli import main
from cxrfl.data.transforms import build_transforms
from cxrfl.nn.models import ModelConfig, build_model, save_checkpoint
from PIL import Image
from pydicom.data import get_testdata_file

CLASSES = ["Cardiomegaly", "Pleural Effusion", "Support Devices"]


@pytest.fixture()
def checkpoint(tmp_path):
    config = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here
    torch.manual_seed(0)
    model = build_model(config, len(CLASSES))
    path = tmp_path / "model.pt"
    save_checkpoint(path, model, classes=CLASSES, model_config=config, extra={"round": 3})
    return path, model, config


def write_dicom(path, pixels: np.ndarray, photometric: str = "MONOCHROME2", bits: int = 12) -> None:
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.PhotometricInterpretation = "DX", photometric
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 1, 16, bits, bits - 1, 0
    ds.PixelData = np.round(pixels).astype(np.uint16).tobytes()
    ds.save_as(str(path), enforce_file_format=True)


def test_predict_prints_every_class_for_png_and_dicom(checkpoint, shared_data, tmp_path, capsys):
    path, model, config = checkpoint
    png = sorted((shared_data / "nih1000" / "images").glob("*.png"))[0]
    dcm = tmp_path / "image.dcm"
    write_dicom(dcm, (np.random.default_rng(0).random((40, 40)) * 4095))

    assert main(["predict", "--model", str(path), str(png), str(dcm), "--json", "--precision", "fp32"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["image"] for r in rows] == [str(png), str(dcm)]
    for r in rows:
        assert list(r["probabilities"]) == CLASSES
        assert all(0.0 <= p <= 1.0 for p in r["probabilities"].values())

    # the same probabilities as the model itself on the same preprocessing
    model.eval()
    x = build_transforms(config.image_size, train=False)(str(png)).unsqueeze(0)
    expected = torch.sigmoid(model(x)).squeeze(0).tolist()
    np.testing.assert_allclose(list(rows[0]["probabilities"].values()), expected, rtol=1e-5)
    assert main(["predict", "--model", str(path), str(png), "--json"]) == 0  # the default: this CPU's training path
    np.testing.assert_allclose(
        list(json.loads(capsys.readouterr().out)[0]["probabilities"].values()), expected, atol=0.01
    )

    assert main(["predict", "--model", str(path), str(png), "--csv"]) == 0
    table = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert table[0] == ["image", *CLASSES, "error"] and len(table) == 2 and table[1][-1] == ""

    assert main(["predict", "--model", str(path), str(png)]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in CLASSES)


def test_predict_names_a_missing_image(checkpoint, tmp_path, capsys):
    path, _, _ = checkpoint
    assert main(["predict", "--model", str(path), str(tmp_path / "nope.png")]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"cxrfl: cannot read image {tmp_path / 'nope.png'}: missing\n" and captured.out == ""


def bad_images(shared_data, tmp_path) -> dict:
    """Unreadable files as a hospital meets them, each with a word its reason must contain."""
    data = sorted((shared_data / "nih1000" / "images").glob("*.png"))[1].read_bytes()
    (tmp_path / "truncated.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.png").write_text("not an image\n")
    files = {
        tmp_path / "truncated.png": "truncated",
        tmp_path / "empty.png": "cannot identify",
        tmp_path / "text.png": "cannot identify",
        tmp_path / "absent.png": "missing",
    }
    for name, reason in (
        ("MR_truncated.dcm", "less than expected"),
        ("rtplan.dcm", "no pixel data"),
        ("rtdose.dcm", "multi-frame"),
        ("JPEG-lossy.dcm", "Unable to decode"),
    ):
        files[Path(get_testdata_file(name))] = reason  # pydicom's own test files
    return files


def test_predict_mixed_batch_predicts_the_good_and_names_each_bad_image(checkpoint, shared_data, tmp_path, capsys):
    path, model, config = checkpoint
    good = [
        sorted((shared_data / "nih1000" / "images").glob("*.png"))[0],
        Path(get_testdata_file("MR_small_jpeg_ls_lossless.dcm")),
    ]  # JPEG-LS: needs the declared plugins
    bad = bad_images(shared_data, tmp_path)
    images = [good[0], *list(bad)[:4], good[1], *list(bad)[4:]]
    transform = build_transforms(config.image_size, train=False)
    model.eval()
    with torch.no_grad():
        expected = {str(g): torch.sigmoid(model(transform(str(g)).unsqueeze(0))).squeeze(0).tolist() for g in good}

    assert main(["predict", "--model", str(path), *map(str, images), "--json", "--precision", "fp32"]) == 1
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [r["image"] for r in rows] == [str(i) for i in images]
    for r in rows:
        if r["image"] in expected:
            np.testing.assert_allclose(list(r["probabilities"].values()), expected[r["image"]], rtol=1e-5)
        else:
            assert set(r) == {"image", "error"} and bad[Path(r["image"])] in r["error"]
    lines = captured.err.splitlines()
    assert len(lines) == len(bad) and "Traceback" not in captured.err and "applying transform" not in captured.err
    for line, image in zip(lines, bad):
        assert line.startswith(f"cxrfl: cannot read image {image}: ") and bad[image] in line

    assert main(["predict", "--model", str(path), *map(str, images), "--csv", "--precision", "fp32"]) == 1
    table = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert table[0] == ["image", *CLASSES, "error"] and len(table) == 1 + len(images)
    for row in table[1:]:
        if row[0] in expected:
            assert row[-1] == "" and [float(v) for v in row[1:-1]] == pytest.approx(expected[row[0]], abs=1e-4)
        else:
            assert row[1:-1] == [""] * len(CLASSES) and bad[Path(row[0])] in row[-1]

    assert main(["predict", "--model", str(path), *map(str, images)]) == 1
    captured = capsys.readouterr()
    assert all(str(g) in captured.out for g in good) and not any(str(b) in captured.out for b in bad)
    assert len(captured.err.splitlines()) == len(bad)


def test_predict_gives_a_png_and_its_monochrome1_dicom_twin_the_same_probabilities(
    checkpoint, shared_data, tmp_path, capsys
):
    path, _, _ = checkpoint
    pngs = sorted((shared_data / "nih1000" / "images").glob("*.png"))[:3]
    twins = []
    for png in pngs:
        gray = np.asarray(Image.open(png).convert("L")).astype(np.float64)
        twins.append(tmp_path / f"{png.stem}.dcm")
        write_dicom(twins[-1], (255.0 - gray) * 257.0, photometric="MONOCHROME1", bits=16)
    assert main(["predict", "--model", str(path), *map(str, pngs + twins), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for a, b in zip(rows[: len(pngs)], rows[len(pngs) :]):
        np.testing.assert_allclose(list(a["probabilities"].values()), list(b["probabilities"].values()), atol=0.01)


def test_predict_refuses_a_file_that_is_not_a_checkpoint(tmp_path, capsys):
    bogus = tmp_path / "bogus.pt"
    torch.save({"weights": 1}, bogus)
    assert main(["predict", "--model", str(bogus), "x.png"]) == 2
    assert "bogus.pt" in capsys.readouterr().err
