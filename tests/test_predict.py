"""`cxrfl predict` on PNG and DICOM images with a self-describing checkpoint."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
import torch

from cxrfl.cli import main
from cxrfl.data.transforms import build_transforms
from cxrfl.nn.models import ModelConfig, build_model, save_checkpoint

CLASSES = ["Cardiomegaly", "Pleural Effusion", "Support Devices"]


@pytest.fixture()
def checkpoint(tmp_path):
    config = ModelConfig(image_size=32)
    torch.manual_seed(0)
    model = build_model(config, len(CLASSES))
    path = tmp_path / "model.pt"
    save_checkpoint(path, model, classes=CLASSES, model_config=config, extra={"round": 3})
    return path, model, config


def write_dicom(path, pixels: np.ndarray) -> None:
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.PhotometricInterpretation = "DX", "MONOCHROME2"
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 1, 16, 12, 11, 0
    ds.PixelData = pixels.astype(np.uint16).tobytes()
    ds.save_as(str(path), enforce_file_format=True)


def test_predict_prints_every_class_for_png_and_dicom(checkpoint, shared_data, tmp_path, capsys):
    path, model, config = checkpoint
    png = sorted((shared_data / "nih1000" / "images").glob("*.png"))[0]
    dcm = tmp_path / "image.dcm"
    write_dicom(dcm, (np.random.default_rng(0).random((40, 40)) * 4095))

    assert main(["predict", "--model", str(path), str(png), str(dcm), "--json"]) == 0
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

    assert main(["predict", "--model", str(path), str(png), "--csv"]) == 0
    table = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert table[0] == ["image", *CLASSES] and len(table) == 2

    assert main(["predict", "--model", str(path), str(png)]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in CLASSES)


def test_predict_names_a_missing_image(checkpoint, tmp_path, capsys):
    path, _, _ = checkpoint
    assert main(["predict", "--model", str(path), str(tmp_path / "nope.png")]) == 2
    err = capsys.readouterr().err
    assert "nope.png" in err and err.count("\n") == 1


def test_predict_refuses_a_file_that_is_not_a_checkpoint(tmp_path, capsys):
    bogus = tmp_path / "bogus.pt"
    torch.save({"weights": 1}, bogus)
    assert main(["predict", "--model", str(bogus), "x.png"]) == 2
    assert "bogus.pt" in capsys.readouterr().err
