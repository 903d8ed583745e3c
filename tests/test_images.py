"""Image reading (PNG/JPEG/DICOM), MONAI transforms and the torch dataset/loader."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pydicom
import pytest
import torch
from cxrfl.data.dataset import CXRDataset, make_loader
from cxrfl.data.images import ImageError, read_image
from cxrfl.data.transforms import IMAGENET_MEAN, IMAGENET_STD, build_transforms
from cxrfl.errors import DataError
from PIL import Image
from pydicom.dataset import FileDataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

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
    rescaled = read_image(
        write_dicom(tmp_path / "r.dcm", pixels, "MONOCHROME2", RescaleSlope="2", RescaleIntercept="-1000", **window)
    )
    hu = pixels * 2.0 - 1000.0  # -1000 .. 2936: the window [-500, 500] cuts both ends
    expected = np.clip((hu - (0 - 500)) / 1000.0, 0.0, 1.0)
    np.testing.assert_allclose(rescaled, expected, atol=2e-3)
    assert (rescaled == 0).any() and (rescaled == 1).any() and ((rescaled > 0) & (rescaled < 1)).any()
    ignored = read_image(write_dicom(tmp_path / "n.dcm", pixels, "MONOCHROME2", **window))  # no rescale
    assert not np.allclose(ignored, rescaled, atol=0.05)
    inverted = read_image(
        write_dicom(tmp_path / "i.dcm", pixels, "MONOCHROME1", RescaleSlope="2", RescaleIntercept="-1000", **window)
    )
    np.testing.assert_allclose(inverted, 1.0 - rescaled, atol=1e-6)


def test_dicom_without_suffix_is_recognised(tmp_path: Path, raw16: np.ndarray) -> None:
    path = write_dicom(tmp_path / "IM000001", raw16, "MONOCHROME2")
    assert read_image(path).max() == pytest.approx(1.0)


def own_range(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return (x - x.min()) / (x.max() - x.min())


def test_png_8_bit_16_bit_rgb_rgba_and_jpeg_use_their_own_range(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    gray = rng.integers(20, 231, (16, 12), dtype=np.uint8)  # does not span 0 .. 255
    Image.fromarray(gray).save(tmp_path / "g8.png")
    np.testing.assert_allclose(read_image(tmp_path / "g8.png"), (gray - 20.0) / 210.0, atol=1e-6)

    deep = rng.integers(0, 65536, (16, 12), dtype=np.uint16)
    Image.fromarray(deep).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    np.testing.assert_allclose(read_image(tmp_path / "g16.png"), own_range(deep), atol=1e-6)

    same = np.stack([gray] * 3, axis=-1)
    Image.fromarray(same).save(tmp_path / "rgb.png")
    np.testing.assert_allclose(read_image(tmp_path / "rgb.png"), own_range(gray), atol=1e-6)

    colour = rng.integers(0, 256, (16, 12, 4), dtype=np.uint8)
    Image.fromarray(colour, mode="RGBA").save(tmp_path / "rgba.png")
    luminance = np.asarray(Image.open(tmp_path / "rgba.png").convert("L"))
    np.testing.assert_allclose(read_image(tmp_path / "rgba.png"), own_range(luminance), atol=1e-6)

    Image.fromarray(gray).save(tmp_path / "g.jpg", quality=95)
    decoded = np.asarray(Image.open(tmp_path / "g.jpg"))
    np.testing.assert_allclose(read_image(tmp_path / "g.jpg"), own_range(decoded), atol=1e-6)

    Image.fromarray(np.full((8, 8), 77, dtype=np.uint8)).save(tmp_path / "flat.png")
    assert not read_image(tmp_path / "flat.png").any()  # a constant image is all 0


def test_16_bit_png_of_12_bit_data_is_not_dark(tmp_path: Path) -> None:
    ramp = np.linspace(100, 4000, 64 * 64).reshape(64, 64).astype(np.uint16)  # 12-bit data in 16 bits
    Image.fromarray(ramp).save(tmp_path / "d12.png")
    Image.fromarray(np.round(ramp / 4000 * 255).astype(np.uint8)).save(tmp_path / "d8.png")
    deep, eight = read_image(tmp_path / "d12.png"), read_image(tmp_path / "d8.png")
    assert deep.max() == 1.0 and abs(float(deep.mean()) - 0.5) < 0.01  # not 4000 / 65535 = 0.06 at most
    np.testing.assert_allclose(deep, eight, atol=1 / 255)


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


def write_twin(png: Path, path: Path, bits: int) -> Path:
    """A MONOCHROME1 DICOM (no window) written from an 8-bit PNG, ``bits`` bits stored in 16."""
    gray = np.asarray(Image.open(png).convert("L")).astype(np.float64)
    stored = np.round((255.0 - gray) * ((2**bits - 1) / 255.0))  # MONOCHROME1: bright bone = low values
    return write_dicom(path, stored, "MONOCHROME1", BitsStored=bits, HighBit=bits - 1)


@pytest.mark.parametrize("bits", [16, 12])
def test_real_png_and_its_monochrome1_dicom_twin_give_the_same_model_input(
    tmp_path: Path, shared_data: Path, bits: int
) -> None:
    transform = build_transforms(64, train=False)
    std = torch.tensor(IMAGENET_STD)[:, None, None]
    for png in sorted((shared_data / "nih1000" / "images").glob("*.png"))[:5]:
        gray = np.asarray(Image.open(png).convert("L"))
        assert np.abs(gray / 255.0 - own_range(gray)).max() > 0.02  # a PNG / 255 would differ from the DICOM
        dcm = write_twin(png, tmp_path / f"{png.stem}.dcm", bits)
        assert np.abs(read_image(png) - read_image(dcm)).max() <= 1 / 255
        model_input = (transform(str(png)) - transform(str(dcm))) * std  # back in intensity units
        assert float(model_input.abs().max()) <= 1 / 255


# ---------------------------------------------------------------- transforms


def test_eval_transform_shape_and_imagenet_normalisation(tmp_path: Path) -> None:
    halves = np.zeros((40, 50), dtype=np.uint8)
    halves[:, 25:] = 90  # own range: the left half 0, the right half 1; mean 0.5
    Image.fromarray(halves).save(tmp_path / "halves.png")
    out = build_transforms(32, train=False)(str(tmp_path / "halves.png"))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (3, 32, 32)
    expected = torch.tensor([(0.5 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)])
    torch.testing.assert_close(out.mean(dim=(1, 2)), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        out[:, :, 0],
        ((0.0 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD))[:, None].expand(3, 32),
        atol=1e-5,
        rtol=0,
    )
    already_read = build_transforms(32, train=False)(read_image(tmp_path / "halves.png"))
    assert torch.equal(already_read, out)
    single = build_transforms(16, train=False, in_channels=1)(str(tmp_path / "halves.png"))
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
        stripe = np.zeros((20, 20), dtype=np.uint8)
        stripe[3 * i : 3 * i + 3] = 200  # a different image each, whatever the intensity policy
        Image.fromarray(stripe).save(tmp_path / f"{i}.png")
        rows.append(
            {"path": str(tmp_path / f"{i}.png"), "patient": str(i), "A": float(i % 2), "B": math.nan if i == 0 else 1.0}
        )
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
    torch.testing.assert_close(
        torch.cat([b[1] for b in plain]),
        torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]]),
    )

    def epoch(seed: int) -> list[torch.Tensor]:
        loader = make_loader(table, ["A", "B"], image_size=16, train=True, batch_size=3, seed=seed)
        return [b[0] for b in loader]

    assert all(torch.equal(a, b) for a, b in zip(epoch(5), epoch(5)))
    assert not all(torch.equal(a, b) for a, b in zip(epoch(5), epoch(6)))
