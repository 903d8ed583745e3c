"""Image reading (PNG/JPEG/DICOM), MONAI transforms and the torch dataset/loader."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pydicom
import pytest
import torch
from PIL import Image
from pydicom.dataset import FileDataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from cxrfl.data.dataset import CXRDataset, make_loader
from cxrfl.data.images import ImageError, read_image
from cxrfl.data.transforms import IMAGENET_MEAN, IMAGENET_STD, build_transforms
from cxrfl.errors import DataError

DX_STORAGE = "1.2.840.10008.5.1.4.1.1.1.1"  # Digital X-Ray Image Storage - For Presentation


def write_dicom(path: Path, pixels: np.ndarray, photometric: str, **elements: object) -> Path:
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = DX_STORAGE
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID = DX_STORAGE
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.Modality = "DX"
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
    for key, value in elements.items():
        setattr(ds, key, value)
    ds.PixelData = pixels.astype(np.uint16).tobytes()
    ds.save_as(path, enforce_file_format=True)
    return path


@pytest.fixture
def raw16() -> np.ndarray:
    return np.arange(0, 40000, 625, dtype=np.uint16).reshape(8, 8)  # 0 .. 39375


def test_dicom_monochrome1_is_inverted(tmp_path: Path, raw16: np.ndarray) -> None:
    mono2 = read_image(write_dicom(tmp_path / "m2.dcm", raw16, "MONOCHROME2"))
    mono1 = read_image(write_dicom(tmp_path / "m1.dcm", raw16, "MONOCHROME1"))
    expected = (raw16 - raw16.min()) / (raw16.max() - raw16.min())
    assert mono2.dtype == np.float32 and mono2.shape == (8, 8)
    np.testing.assert_allclose(mono2, expected, atol=1e-6)
    np.testing.assert_allclose(mono1, 1.0 - expected, atol=1e-6)
    assert pydicom.dcmread(tmp_path / "m1.dcm").PhotometricInterpretation == "MONOCHROME1"


def test_dicom_rescale_then_window(tmp_path: Path, raw16: np.ndarray) -> None:
    pixels = (raw16 // 20).astype(np.uint16)  # 0 .. 1968
    window = {"WindowCenter": "0", "WindowWidth": "1000"}
    rescaled = read_image(write_dicom(tmp_path / "r.dcm", pixels, "MONOCHROME2", RescaleSlope="2",
                                      RescaleIntercept="-1000", **window))
    hu = pixels * 2.0 - 1000.0  # -1000 .. 2936: the window [-500, 500] cuts both ends
    expected = np.clip((hu - (0 - 500)) / 1000.0, 0.0, 1.0)
    np.testing.assert_allclose(rescaled, expected, atol=2e-3)
    assert (rescaled == 0).any() and (rescaled == 1).any() and ((rescaled > 0) & (rescaled < 1)).any()
    ignored = read_image(write_dicom(tmp_path / "n.dcm", pixels, "MONOCHROME2", **window))  # no rescale
    assert not np.allclose(ignored, rescaled, atol=0.05)
    inverted = read_image(write_dicom(tmp_path / "i.dcm", pixels, "MONOCHROME1", RescaleSlope="2",
                                      RescaleIntercept="-1000", **window))
    np.testing.assert_allclose(inverted, 1.0 - rescaled, atol=1e-6)


def test_dicom_without_suffix_is_recognised(tmp_path: Path, raw16: np.ndarray) -> None:
    path = write_dicom(tmp_path / "IM000001", raw16, "MONOCHROME2")
    assert read_image(path).max() == pytest.approx(1.0)


def test_png_8_bit_16_bit_rgb_rgba_and_jpeg(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    gray = rng.integers(0, 256, (16, 12), dtype=np.uint8)
    Image.fromarray(gray).save(tmp_path / "g8.png")
    np.testing.assert_allclose(read_image(tmp_path / "g8.png"), gray / 255.0, atol=1e-7)

    deep = rng.integers(0, 65536, (16, 12), dtype=np.uint16)
    Image.fromarray(deep).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    np.testing.assert_allclose(read_image(tmp_path / "g16.png"), deep / 65535.0, atol=1e-7)

    same = np.stack([gray] * 3, axis=-1)
    Image.fromarray(same).save(tmp_path / "rgb.png")
    np.testing.assert_allclose(read_image(tmp_path / "rgb.png"), gray / 255.0, atol=1e-7)

    colour = rng.integers(0, 256, (16, 12, 4), dtype=np.uint8)
    Image.fromarray(colour, mode="RGBA").save(tmp_path / "rgba.png")
    luminance = np.asarray(Image.open(tmp_path / "rgba.png").convert("L")) / 255.0
    np.testing.assert_allclose(read_image(tmp_path / "rgba.png"), luminance, atol=1e-7)

    Image.fromarray(gray).save(tmp_path / "g.jpg", quality=95)
    decoded = np.asarray(Image.open(tmp_path / "g.jpg")) / 255.0
    np.testing.assert_allclose(read_image(tmp_path / "g.jpg"), decoded, atol=1e-7)


def test_corrupt_truncated_and_missing_images_name_the_file(tmp_path: Path) -> None:
    noise = np.random.default_rng(1).integers(0, 256, (64, 64), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "whole.png")
    data = (tmp_path / "whole.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.png").write_text("this is not an image\n")
    (tmp_path / "empty.dcm").write_bytes(b"")
    for name in ("truncated.png", "text.png", "empty.dcm", "missing.png"):
        with pytest.raises(DataError) as info:
            read_image(tmp_path / name)
        assert str(tmp_path / name) in str(info.value)
        assert isinstance(info.value, ImageError) and info.value.path == str(tmp_path / name)
    with pytest.raises(ImageError) as info:
        read_image(tmp_path / "missing.png")
    assert info.value.reason == "missing"


# ---------------------------------------------------------------- transforms


def test_eval_transform_shape_and_imagenet_normalisation(tmp_path: Path) -> None:
    Image.fromarray(np.full((40, 50), 51, dtype=np.uint8)).save(tmp_path / "flat.png")  # 51/255 = 0.2
    out = build_transforms(32, train=False)(str(tmp_path / "flat.png"))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (3, 32, 32)
    expected = torch.tensor([(0.2 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)])
    torch.testing.assert_close(out.mean(dim=(1, 2)), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.std(dim=(1, 2)), torch.zeros(3), atol=1e-5, rtol=0)
    single = build_transforms(16, train=False, in_channels=1)(str(tmp_path / "flat.png"))
    assert single.shape == (1, 16, 16)
    with pytest.raises(ValueError, match="in_channels"):
        build_transforms(16, train=False, in_channels=2)


def test_train_transform_augments_reproducibly(tmp_path: Path) -> None:
    ramp = np.tile(np.linspace(0, 255, 48).astype(np.uint8), (48, 1))
    Image.fromarray(ramp).save(tmp_path / "ramp.png")
    path = str(tmp_path / "ramp.png")
    plain = build_transforms(48, train=False)(path)
    outputs = []
    for seed in (0, 0, 1):
        transform = build_transforms(48, train=True)
        transform.set_random_state(seed)
        outputs.append(torch.stack([transform(path) for _ in range(4)]))
    assert torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], outputs[2])
    assert any(not torch.allclose(o, plain) for o in outputs[0])  # something was augmented
    assert outputs[0].shape == (4, 3, 48, 48) and torch.isfinite(outputs[0]).all()


# ---------------------------------------------------------------- dataset and loader


@pytest.fixture
def table(tmp_path: Path) -> pd.DataFrame:
    rows = []
    for i in range(6):
        Image.fromarray(np.full((20, 20), 40 * i, dtype=np.uint8)).save(tmp_path / f"{i}.png")
        rows.append({"path": str(tmp_path / f"{i}.png"), "patient": str(i), "A": float(i % 2),
                     "B": math.nan if i == 0 else 1.0})
    return pd.DataFrame(rows)


def test_dataset_items_target_and_mask(table: pd.DataFrame) -> None:
    dataset = CXRDataset(table, ["B", "A"], build_transforms(16, train=False))
    image, target, mask = dataset[0]
    assert len(dataset) == 6 and image.shape == (3, 16, 16)
    assert target.dtype == torch.float32 and target.tolist() == [0.0, 0.0] and mask.tolist() == [0.0, 1.0]
    assert dataset[1][1].tolist() == [1.0, 1.0] and dataset[1][2].tolist() == [1.0, 1.0]


def test_loader_batches_cache_and_seeded_shuffling(table: pd.DataFrame) -> None:
    evaluate = [make_loader(table, ["A", "B"], image_size=16, train=False, batch_size=4, cache=c) for c in (0, 1)]
    plain, cached = ([b for b in loader] for loader in evaluate)
    assert [b[0].shape for b in plain] == [(4, 3, 16, 16), (2, 3, 16, 16)]
    for a, b in zip(plain, cached):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    torch.testing.assert_close(torch.cat([b[1] for b in plain]), torch.tensor(
        [[0.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]]))

    def epoch(seed: int) -> list[torch.Tensor]:
        loader = make_loader(table, ["A", "B"], image_size=16, train=True, batch_size=3, seed=seed)
        return [b[0] for b in loader]

    assert all(torch.equal(a, b) for a, b in zip(epoch(5), epoch(5)))
    assert not all(torch.equal(a, b) for a, b in zip(epoch(5), epoch(6)))
