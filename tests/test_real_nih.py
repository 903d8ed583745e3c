"""The readers, splits and transforms on the real NIH ChestX-ray14 files in ../shared/data."""

from __future__ import annotations

import csv
import dataclasses
import gzip
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from cxrfl.data.images import read_image
from cxrfl.data.readers import read_labels
from cxrfl.data.site import SiteData, load_site
from cxrfl.data.site_config import SplitConfig, load_site_config, site_config_from_dict
from cxrfl.data.transforms import IMAGENET_MEAN, IMAGENET_STD, build_transforms
from PIL import Image

NIH_TO_CANONICAL = {"Effusion": "Pleural Effusion", "Pleural_Thickening": "Pleural Thickening"}
README_POSITIVES = {  # data/README.md, NIH spelling
    "Effusion": 170,
    "Infiltration": 162,
    "Atelectasis": 95,
    "Cardiomegaly": 83,
    "Consolidation": 42,
    "Pneumothorax": 40,
    "Nodule": 39,
    "Emphysema": 37,
    "Mass": 35,
    "Fibrosis": 32,
    "Edema": 31,
    "Pleural_Thickening": 29,
    "Pneumonia": 11,
    "Hernia": 9,
}


@pytest.fixture(scope="module")
def nih1000(repo_root: Path, shared_data: Path) -> SiteData:
    return load_site(repo_root / "site_configs" / "nih1000.yaml")


def count_with_csv_module(path: Path) -> tuple[int, set[str], Counter]:
    """Images, patients and per-finding counts by plain string handling of the raw file."""
    with gzip.open(path, "rt", newline="") as fh:
        rows = csv.reader(fh)
        header = next(rows)
        labels, patient = header.index("Finding Labels"), header.index("Patient ID")
        images, patients, counts = 0, set(), Counter()
        for row in rows:
            images += 1
            patients.add(row[patient])
            counts.update(f for f in row[labels].split("|") if f != "No Finding")
    return images, patients, counts


def test_full_nih_label_file(shared_data: Path) -> None:
    path = shared_data / "nih" / "Data_Entry_2017_v2020.csv.gz"
    cfg = site_config_from_dict(
        {
            "site": "nih",
            "dataset": {"format": "nih", "labels": str(path), "images": str(shared_data / "nih" / "images")},
        }
    )
    table = read_labels(cfg)
    images, patients, counts = count_with_csv_module(path)
    assert (images, len(patients)) == (112_120, 30_805)
    assert len(table) == images and table["patient"].nunique() == len(patients)
    assert set(table["patient"]) == patients
    assert len(counts) == 14
    assert {c: int(table[c].sum()) for c in table.columns[2:-3]} == {
        NIH_TO_CANONICAL.get(name, name): n for name, n in counts.items()
    }


def test_nih1000_site_from_the_shipped_config(nih1000: SiteData) -> None:
    table = nih1000.table
    assert len(table) == 1000 and table["patient"].nunique() == 264 and nih1000.skipped == []
    assert len(nih1000.classes) == 14 and "Pleural Effusion" in nih1000.classes
    assert nih1000.positives() == {NIH_TO_CANONICAL.get(k, k): v for k, v in README_POSITIVES.items()}
    assert list(table.columns[:3]) == ["path", "patient", "split"]
    assert all(Path(p).is_absolute() and Path(p).is_file() for p in table["path"])
    assert int((table[nih1000.classes].sum(axis=1) >= 2).sum()) == 213


def test_nih1000_splits_by_patient_stratified_and_seeded(repo_root: Path, nih1000: SiteData) -> None:
    table = nih1000.table
    assert table.groupby("patient")["split"].nunique().max() == 1  # no patient in two splits
    patients = table.groupby("split")["patient"].nunique()
    assert patients.sum() == 264
    assert abs(patients["train"] - 0.7 * 264) <= 2 and abs(patients["val"] - 0.1 * 264) <= 2
    for split in ("train", "val", "test"):
        missing = [c for c, n in nih1000.positives(split).items() if n == 0]
        assert missing == [] or missing == ["Hernia"]  # Hernia: 9 images of 2 patients
    cfg = load_site_config(repo_root / "site_configs" / "nih1000.yaml")
    again = load_site(cfg, check_images=False)
    assert again.table["split"].tolist() == table["split"].tolist()
    other = load_site(dataclasses.replace(cfg, split=SplitConfig(seed=1)), check_images=False)
    assert other.table["split"].tolist() != table["split"].tolist()
    assert other.table.groupby("patient")["split"].nunique().max() == 1


def test_nih1000_rgb_and_rgba_pngs_become_one_channel(nih1000: SiteData) -> None:
    modes: dict[str, list[str]] = {}
    for path in nih1000.table["path"]:
        with Image.open(path) as img:
            modes.setdefault(img.mode, []).append(path)
    assert len(modes.get("RGBA", [])) == 21 and len(modes.get("RGB", [])) == 979
    for path in modes["RGBA"][:5] + modes["RGB"][:5]:
        with Image.open(path) as img:
            channel0 = np.asarray(img)[..., 0].astype(np.float64)
            luminance = np.asarray(img.convert("L")).astype(np.float64)
        channel0, luminance = ((x - x.min()) / (x.max() - x.min()) for x in (channel0, luminance))  # own range
        gray = read_image(path)
        assert gray.shape == (64, 64) and gray.dtype == np.float32
        np.testing.assert_allclose(gray, channel0, atol=1e-6)
        np.testing.assert_allclose(gray, luminance, atol=1e-6)


def test_nih1000_transforms(nih1000: SiteData) -> None:
    path = nih1000.table["path"].iloc[0]
    out = build_transforms(64, train=False)(path)
    assert out.shape == (3, 64, 64) and out.dtype == torch.float32
    gray = torch.from_numpy(read_image(path))
    for c, (mean, std) in enumerate(zip(IMAGENET_MEAN, IMAGENET_STD)):
        torch.testing.assert_close(out[c], (gray - mean) / std, atol=1e-5, rtol=0)
    train = build_transforms(64, train=True)
    train.set_random_state(0)
    augmented = torch.stack([train(path) for _ in range(8)])
    assert augmented.shape == (8, 3, 64, 64) and torch.isfinite(augmented).all()
    gray_again = [augmented[:, c] * std + mean for c, (mean, std) in enumerate(zip(IMAGENET_MEAN, IMAGENET_STD))]
    torch.testing.assert_close(gray_again[0], gray_again[1], atol=1e-5, rtol=0)  # one gray image, replicated
    torch.testing.assert_close(gray_again[0], gray_again[2], atol=1e-5, rtol=0)
