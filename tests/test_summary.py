"""Loading a whole site (image checks, bad-image policies, splits) and `cxrfl data summary`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from cxrfl.cli import main
from cxrfl.data.site import load_site
from cxrfl.data.site_config import SplitConfig
from cxrfl.data.splits import patient_split
from cxrfl.data.summary import format_summary, summarise
from cxrfl.errors import DataError
from PIL import Image

BAD = {"truncated.png": "truncated", "text.png": "not an image", "missing.png": "missing"}


@pytest.fixture
def site_dir(tmp_path: Path) -> Path:
    """A generic-CSV site of 24 images (12 patients) of which 3 are bad."""
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    lines = ["file,patient,Cardiomegaly,Edema"]
    for i in range(21):
        Image.fromarray(rng.integers(0, 256, (32, 32), dtype=np.uint8)).save(images / f"{i:02d}.png")
        lines.append(f"{i:02d}.png,p{i // 2},{int(i % 3 == 0)},{'' if i == 4 else int(i % 4 == 0)}")
    Image.fromarray(rng.integers(0, 256, (64, 64), dtype=np.uint8)).save(images / "truncated.png")
    data = (images / "truncated.png").read_bytes()
    (images / "truncated.png").write_bytes(data[: len(data) // 3])
    (images / "text.png").write_text("not a picture")
    lines += [f"{name},p{10 + k // 2},1,0" for k, name in enumerate(BAD)]
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    return tmp_path


def write_config(site_dir: Path, **changes: object) -> Path:
    data = {
        "site": "hospital-x",
        "dataset": {
            "format": "csv",
            "labels": "labels.csv",
            "images": "images",
            "path_column": "file",
            "patient_column": "patient",
        },
        "max_bad_fraction": 0.2,
        **changes,
    }
    path = site_dir / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_bad_images_are_skipped_and_listed(site_dir: Path) -> None:
    site = load_site(write_config(site_dir))
    assert len(site.table) == 21 and site.classes == ["Cardiomegaly", "Edema"]
    assert sorted(Path(p).name for p, _ in site.skipped) == sorted(BAD)
    assert dict((Path(p).name, r) for p, r in site.skipped)["missing.png"] == "missing"
    assert any("3 image(s) skipped" in p for p in site.problems)
    assert site.table["split"].isin(["train", "val", "test"]).all()
    assert site.table.groupby("patient")["split"].nunique().max() == 1
    assert site.positives() == {"Cardiomegaly": 7, "Edema": 5}
    assert site.table["Edema"].isna().sum() == 1  # blank in a generic CSV = not annotated
    assert sum(len(site.split_table(s)) for s in ("train", "val", "test")) == 21


def test_without_decoding_only_missing_images_are_found(site_dir: Path) -> None:
    site = load_site(write_config(site_dir), check_images=False)
    assert [Path(p).name for p, _ in site.skipped] == ["missing.png"] and len(site.table) == 23


def test_error_policy_names_the_first_bad_image(site_dir: Path) -> None:
    with pytest.raises(DataError) as info:
        load_site(write_config(site_dir, bad_images="error"))
    assert str(site_dir / "images" / "truncated.png") in str(info.value) and "bad_images: skip" in str(info.value)


def test_too_many_bad_images_stop_the_site(site_dir: Path) -> None:
    with pytest.raises(DataError) as info:
        load_site(write_config(site_dir, max_bad_fraction=0.05))
    message = str(info.value)
    assert "3 of 24 images" in message and "max_bad_fraction" in message and str(site_dir / "images") in message


def test_summary_counts_and_table(site_dir: Path) -> None:
    summary = summarise(write_config(site_dir))
    assert summary["site"] == "hospital-x" and summary["format"] == "csv"
    assert (summary["images"], summary["patients"], summary["skipped"]) == (21, 11, 3)
    assert summary["classes"] == ["Cardiomegaly", "Edema"]
    assert summary["positives"] == {"Cardiomegaly": 7, "Edema": 5} and summary["unknown"]["Edema"] == 1
    assert sum(summary["splits"].values()) == 21 and set(summary["splits"]) == {"train", "val", "test"}
    assert sum(summary["split_positives"][s]["Cardiomegaly"] for s in summary["splits"]) == 7
    assert len(summary["skipped_examples"]) == 3 and json.loads(json.dumps(summary)) == summary
    text = format_summary(summary)
    assert "hospital-x" in text and "Cardiomegaly" in text and "missing.png: missing" in text


def test_a_class_without_positives_is_a_problem_not_a_crash(site_dir: Path) -> None:
    labels = site_dir / "labels.csv"
    labels.write_text(
        labels.read_text()
        .replace("file,patient,Cardiomegaly,Edema", "file,patient,Cardiomegaly,Mass")
        .replace(",1\n", ",0\n")
    )
    summary = summarise(write_config(site_dir))
    assert summary["positives"]["Mass"] == 0
    assert any("'Mass' has no positive image" in p for p in summary["problems"])


def test_cli_summary_json(site_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "summary", str(write_config(site_dir)), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    for key in (
        "site",
        "format",
        "images",
        "patients",
        "classes",
        "positives",
        "splits",
        "split_positives",
        "skipped",
        "skipped_examples",
        "problems",
    ):
        assert key in printed
    assert printed["images"] == 21 and printed["skipped"] == 3


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"dataset": {"format": "dicomdir", "labels": "labels.csv", "images": "images"}}, "dataset.format"),
        ({"dataset": {"format": "csv", "labels": "nope.csv", "images": "images"}}, "nope.csv does not exist"),
        ({"dataset": {"format": "csv", "labels": "labels.csv", "images": "images"}}, "has no column(s) 'path'"),
        ({"max_bad_fraction": "5%"}, "max_bad_fraction must be a number, got '5%'"),
        ({"split": {"seed": "abc"}}, "split.seed must be an integer, got 'abc'"),
        ({"classes": "Cardiomegaly"}, "classes must be a list of texts or null, got 'Cardiomegaly'"),
    ],
)
def test_cli_bad_config_exits_2_with_one_line(
    site_dir: Path, capsys: pytest.CaptureFixture[str], change: dict, expected: str
) -> None:
    config = write_config(site_dir, **change)
    assert main(["data", "summary", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cxrfl: error: ") and err.count("\n") == 1 and expected in err


def test_patient_split_stratifies_rare_classes_and_is_seeded() -> None:
    rows = [{"patient": f"p{p}", "Hernia": float(p < 3), "Mass": float(p % 3 == 0)} for p in range(30) for _ in (0, 1)]
    table = pd.DataFrame(rows)
    split = patient_split(table, ["Hernia", "Mass"], SplitConfig())
    assert split.index.equals(table.index)
    per_patient = split.groupby(table["patient"]).unique()
    assert per_patient.map(len).max() == 1
    counts = per_patient.map(lambda s: s[0]).value_counts()
    assert counts.to_dict() == {"train": 21, "test": 6, "val": 3}
    for name in ("train", "val", "test"):  # 3 Hernia patients: one in each split
        assert table.loc[split == name, "Hernia"].sum() == 2
        assert table.loc[split == name, "Mass"].sum() > 0
    assert split.equals(patient_split(table, ["Hernia", "Mass"], SplitConfig()))
    assert not split.equals(patient_split(table, ["Hernia", "Mass"], SplitConfig(seed=1)))
    no_val = patient_split(table, ["Hernia", "Mass"], SplitConfig(train=0.8, val=0.0, test=0.2))
    assert set(no_val) == {"train", "test"}
