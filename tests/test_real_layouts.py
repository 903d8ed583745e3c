"""Native layouts (issue 41): one folder per class, one categorical finding column, a registry of one
disease; read as published, on tiny synthetic trees and on the real sets in ../shared/data/real."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import require_data
from cxrfl.cli import main
from cxrfl.data.readers import read_labels
from cxrfl.data.site import load_site, training_refusal
from cxrfl.data.site_config import load_site_config
from cxrfl.data.summary import summarise
from cxrfl.errors import DataError
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
REAL = REPO.parent / "shared" / "data" / "real"
REAL_CONFIGS = sorted((REPO / "site_configs" / "real").glob("*.yaml"))
KERMANY_PATTERN = r"^(?P<patient>person\d+|(?:NORMAL2-)?IM-\d+)"


@pytest.fixture(scope="module")
def real() -> Path:
    """The real sets; skipped with a message where absent, but a failure in CI (CI is set)."""
    require_data(
        all((REAL / name).is_dir() for name in ("kermany_pediatric", "hannover_mhh_covid")),
        f"real data not found at {REAL} (the shared/ folder beside the checkout)",
    )
    return REAL


def test_absent_real_data_skips_but_fails_when_ci_is_set(monkeypatch):
    # issue 44 point 3: in CI a missing ../shared/data must fail the tests that need it, not skip them
    monkeypatch.delenv("CI", raising=False)
    require_data(True, "unused")
    with pytest.raises(pytest.skip.Exception, match="^no data at /x$"):
        require_data(False, "no data at /x")
    monkeypatch.setenv("CI", "true")
    require_data(True, "unused")
    with pytest.raises(pytest.fail.Exception, match="^no data at /x; CI must have it$"):
        require_data(False, "no data at /x")


def png(path: Path, value: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8), value, dtype=np.uint8)).save(path)


def write_yaml(folder: Path, dataset: dict, **top: object) -> Path:
    path = folder / "site.yaml"
    path.write_text(yaml.safe_dump({"site": "h", "dataset": dataset, **top}, sort_keys=False))
    return path


def one_line_error(config: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["data", "summary", str(config), "--no-image-check"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ------------------------------------------------------------------ (a) one folder per class
@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """images/{train,test}/{NORMAL,PNEUMONIA}: 12 train + 4 test patients, Kermany's file names."""
    for i in range(6):
        png(tmp_path / f"images/train/NORMAL/IM-{i:04d}-0001.png")
        png(tmp_path / f"images/train/PNEUMONIA/person{i}_bacteria_{i}.png")
        png(tmp_path / f"images/train/PNEUMONIA/person{i + 10}_virus_{i}.png")
    png(tmp_path / "images/train/PNEUMONIA/person99_unsure.png")  # neither sub-class
    for i in range(2):
        png(tmp_path / f"images/test/NORMAL/IM-{i + 50:04d}-0001.png")
        png(tmp_path / f"images/test/PNEUMONIA/person{i + 50}_virus_{i}.png")
    (tmp_path / "images/README.txt").write_text("not an image")
    return tmp_path


def folders(**changes: object) -> dict:
    return {
        "format": "folders",
        "images": "images",
        "class_folders": {"NORMAL": None, "PNEUMONIA": "Pneumonia"},
        "split_folders": {"train": "train", "test": "test"},
        "patient_pattern": KERMANY_PATTERN,
        "subclasses": {"PNEUMONIA": {"bacteria": "Bacterial Pneumonia", "virus": "Viral Pneumonia"}},
        **changes,
    }


def test_folders_classes_subclasses_patients_and_given_split(tree: Path) -> None:
    # issue 41 (a): folder = class, null = no finding, sub-class and patient from the file name
    table = read_labels(load_site_config(write_yaml(tree, folders())))
    assert list(table.columns) == ["path", "patient", "split", "Pneumonia", "Bacterial Pneumonia", "Viral Pneumonia"]
    row = table.set_index(table["path"].map(lambda p: Path(p).name))
    classes = ["Pneumonia", "Bacterial Pneumonia", "Viral Pneumonia"]
    assert row.loc["IM-0003-0001.png", classes].tolist() == [0, 0, 0]
    assert row.loc["person3_bacteria_3.png", classes].tolist() == [1, 1, 0]
    assert row.loc["person51_virus_1.png", classes].tolist() == [1, 0, 1]
    unsure = row.loc["person99_unsure.png", classes].tolist()
    assert unsure[0] == 1 and all(math.isnan(v) for v in unsure[1:])  # sub-class not labelled: masked
    assert row.loc["IM-0003-0001.png", "patient"] == "IM-0003"
    assert row.loc["person51_virus_1.png", "patient"] == "person51"
    assert Counter(table["split"]) == {"train": 19, "test": 4}
    assert any("README.txt" in p and "not an image" in p for p in table.attrs["problems"])


def test_given_split_without_val_gets_val_from_train_patients(tree: Path) -> None:
    # issue 41 (a): Kermany ships train and test only; the job refused a site with an empty val split
    site = load_site(write_yaml(tree, folders()), check_images=False)
    sizes = site.split_sizes()
    assert sizes["val"] > 0 and sizes["test"] == 4 and sizes["train"] + sizes["val"] == 19
    assert site.table.groupby("patient")["split"].nunique().max() == 1
    assert training_refusal(site) is None
    assert any("no val split" in p for p in site.problems)


def test_a_folder_that_is_not_a_class_is_one_line(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # issue 41: bad variant, a folder that is not a class
    png(tree / "images/train/COVID/x.png")
    err = one_line_error(write_yaml(tree, folders()), capsys)
    assert "'COVID'" in err and "dataset.class_folders" in err and str(tree / "images" / "train" / "COVID") in err


def test_a_split_folder_that_is_not_listed_is_one_line(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png(tree / "images/val/NORMAL/IM-0999-0001.png")
    err = one_line_error(write_yaml(tree, folders()), capsys)
    assert "'val'" in err and "dataset.split_folders" in err


def test_a_patient_pattern_that_matches_no_file_is_one_line(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # issue 41: bad variant, a pattern that matches no file
    err = one_line_error(write_yaml(tree, folders(patient_pattern=r"^(?P<patient>patient\d+)")), capsys)
    assert "dataset.patient_pattern" in err and "matches no file" in err


def test_a_subclass_pattern_that_matches_no_file_is_one_line(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(write_yaml(tree, folders(subclasses={"PNEUMONIA": {"fungal": "Fungal Pneumonia"}})), capsys)
    assert "dataset.subclasses" in err and "'fungal'" in err and "matches no file" in err


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"patient_pattern": r"^(person\d+)"}, "named group (?P<patient>"),
        ({"patient_pattern": r"^(?P<patient>person\d+"}, "not a valid regular expression"),
        ({"class_folders": None}, "dataset.class_folders is missing (format folders needs it)"),
        ({"subclasses": {"NORMAL": {"x": "Y"}}}, "no-finding folder"),
        ({"split_folders": {"train": "training set"}}, "train, val or test"),
        ({"finding_column": "finding"}, "dataset.finding_column is only read for format categorical"),
    ],
)
def test_bad_folder_settings_are_one_line(
    tree: Path, capsys: pytest.CaptureFixture[str], change: dict, expected: str
) -> None:
    err = one_line_error(write_yaml(tree, {k: v for k, v in folders(**change).items() if v is not None}), capsys)
    assert expected in err and str(tree / "site.yaml") in err


def test_a_patient_in_two_given_splits_follows_dataset_overlap(tree: Path) -> None:
    # issue 41 (a): Kermany's 170 ids in train and test; the given split was refused, with no way out
    png(tree / "images/test/PNEUMONIA/person3_bacteria_77.png")  # person3 is in train too
    with pytest.raises(DataError, match=r"1 patient\(s\) appear in more than one split.*dataset.overlap"):
        load_site(write_yaml(tree, folders()), check_images=False)
    moved = load_site(write_yaml(tree, folders(overlap="move")), check_images=False)
    person3 = moved.table[moved.table["patient"] == "person3"]
    assert len(person3) == 2 and person3["split"].nunique() == 1 and "test" not in set(person3["split"])
    assert moved.split_sizes()["test"] == 4
    assert any("1 patient(s)" in p and "1 image(s)" in p and "moved" in p for p in moved.problems)
    dropped = load_site(write_yaml(tree, folders(overlap="drop")), check_images=False)
    assert len(dropped.table) == 23 and (dropped.table["patient"] == "person3").sum() == 1
    resplit = load_site(write_yaml(tree, folders(overlap="resplit")), check_images=False)
    assert len(resplit.table) == 24 and resplit.table.groupby("patient")["split"].nunique().max() == 1


def test_a_symlink_out_of_the_image_folder_is_refused(tree: Path) -> None:
    # builds on issue 40's confinement: a class folder may not lead outside dataset.images
    png(tree / "elsewhere/IM-0777-0001.png")
    (tree / "images/train/NORMAL/IM-0777-0001.png").symlink_to(tree / "elsewhere/IM-0777-0001.png")
    table = read_labels(load_site_config(write_yaml(tree, folders())))
    assert len(table) == 23 and not table["path"].str.contains("0777").any()
    assert any("IM-0777-0001.png" in p and "outside dataset.images" in p for p in table.attrs["problems"])


# ---------------------------------------------------- (b) one categorical finding column
def categorical_site(tmp_path: Path, rows: list[str]) -> Path:
    (tmp_path / "images").mkdir()
    for line in rows:
        (tmp_path / "images" / line.split(",")[0]).write_bytes(b"")
    (tmp_path / "meta.csv").write_text("filename,patientid,finding,view\n" + "\n".join(rows) + "\n")
    return write_yaml(
        tmp_path,
        {
            "format": "categorical",
            "labels": "meta.csv",
            "images": "images",
            "path_column": "filename",
            "patient_column": "patientid",
            "finding_column": "finding",
            "values": {"Pneumonia/Viral/COVID-19": "COVID-19", "Pneumonia/Bacterial": "Pneumonia", "No Finding": None},
            "unlabelled_values": ["todo"],
        },
        split={"train": 0.5, "val": 0.25, "test": 0.25},
    )


def test_categorical_values_map_to_classes(tmp_path: Path) -> None:
    # issue 41 (b): value -> class, a value meaning no finding, values meaning not labelled
    config = categorical_site(
        tmp_path,
        [
            "a.png,p1,Pneumonia/Viral/COVID-19,PA",
            "b.png,p2,pneumonia/bacterial,AP",
            "c.png,p3,No Finding,PA",
            "d.png,p4,todo,PA",
            "e.png,p5,,PA",
        ],
    )
    table = read_labels(load_site_config(config))
    assert list(table.columns) == ["path", "patient", "COVID-19", "Pneumonia"]
    values = table[["COVID-19", "Pneumonia"]].to_numpy()
    np.testing.assert_array_equal(values[:3], [[1, 0], [0, 1], [0, 0]])
    assert np.isnan(values[3:]).all()  # todo and blank: not labelled


def test_an_unmapped_categorical_value_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # issue 41: bad variant, a categorical value not mapped
    config = categorical_site(
        tmp_path, ["a.png,p1,No Finding,PA", "b.png,p2,Pneumonia/Fungal,PA", "c.png,p3,Tuberculosis,PA"]
    )
    err = one_line_error(config, capsys)
    assert f"{tmp_path / 'meta.csv'}, line 3, column 'finding'" in err and "'Pneumonia/Fungal'" in err
    assert "'Tuberculosis'" in err and "dataset.values" in err and "dataset.unlabelled_values" in err


def test_the_categorical_example_config_is_valid() -> None:
    config = load_site_config(REPO / "site_configs" / "examples" / "categorical.yaml")
    assert config.dataset.values["No Finding"] is None and config.dataset.unlabelled_values == ("todo",)


# ---------------------------------------------------- (c) a registry of one disease
def registry_site(tmp_path: Path, n: int = 20) -> Path:
    rows = []
    for i in range(n):
        png(tmp_path / f"png/img{i}.png", value=i)
        rows.append(f"pt{i // 2},img{i},{'' if i % 3 else -i}")
    (tmp_path / "data.csv").write_text("patient_id,image_id,icu_admission_offset\n" + "\n".join(rows) + "\n")
    return write_yaml(
        tmp_path,
        {
            "format": "registry",
            "labels": "data.csv",
            "images": "png",
            "path_column": "image_id",
            "image_suffix": ".png",
            "patient_column": "patient_id",
            "site_label": "COVID-19",
            "derived": {"ICU admission": "icu_admission_offset"},
        },
    )


def test_registry_site_label_and_derived_labels(tmp_path: Path) -> None:
    # issue 41 (c): a label for every image of the site, a binary label from a column being filled
    site = load_site(registry_site(tmp_path))
    assert site.classes == ["COVID-19", "ICU admission"]
    assert site.positives() == {"COVID-19": 20, "ICU admission": 7} and site.negatives()["ICU admission"] == 13
    assert site.negatives()["COVID-19"] == 0 and site.one_sided_classes() == {"COVID-19": 1.0}
    assert Path(site.table["path"][0]).parent == (tmp_path / "png").resolve()


def test_a_class_without_negatives_is_reported_and_the_site_still_takes_part(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # issue 41 point 2: every Hannover image is COVID-19; the summary did not say its head cannot learn "no"
    config = registry_site(tmp_path)
    assert main(["data", "summary", str(config)]) == 0
    out = capsys.readouterr().out
    line = [p for p in out.splitlines() if "'COVID-19'" in p and "no negative" in p]
    assert len(line) == 1 and "cannot learn to say no" in line[0]
    summary = summarise(config)
    assert summary["refused"] is None and summary["one_sided"] == {"COVID-19": 1.0}


def test_a_class_with_few_positives_or_negatives_in_a_split_is_reported(tmp_path: Path) -> None:
    # issue 41 point 2: fewer than min_class_images positives or negatives of a class in a split
    config = registry_site(tmp_path)
    site = load_site(config, check_images=False)
    val = site.split_table("val")
    few = [p for p in site.problems if "'ICU admission'" in p and "fewer than 5" in p]
    assert val["ICU admission"].eq(1).sum() < 5 and few and "val" in few[0]
    relaxed = yaml.safe_load(config.read_text()) | {"min_class_images": 1}
    config.write_text(yaml.safe_dump(relaxed))
    assert not [p for p in load_site(config, check_images=False).problems if "fewer than" in p]


# ---------------------------------------------------- the real sets, as published
def test_every_real_config_summarises(real: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # issue 41: `cxrfl data summary` on each site_configs/real/*.yaml succeeds on a clean checkout
    assert {p.stem for p in REAL_CONFIGS} >= {"kermany_pediatric", "hannover_mhh_covid"}
    for config in REAL_CONFIGS:
        assert main(["data", "summary", str(config), "--no-image-check"]) == 0, capsys.readouterr().err


def test_kermany_counts_match_its_readme(real: Path) -> None:
    # issue 41 (a): data/real/kermany_pediatric/README.md, counts after duplicate removal
    config = load_site_config(REPO / "site_configs" / "real" / "kermany_pediatric.yaml")
    table = read_labels(config)

    def count(split: str, mask: pd.Series) -> int:
        return int((mask & (table["split"] == split)).sum())

    counts = {
        s: (
            count(s, table["Pneumonia"] == 0),
            count(s, table["Bacterial Pneumonia"] == 1),
            count(s, table["Viral Pneumonia"] == 1),
        )
        for s in ("train", "test")
    }
    assert counts == {"train": (1340, 2512, 1338), "test": (231, 240, 147)} and len(table) == 5808
    assert table["patient"].nunique() == 3102
    assert int((table.groupby("patient")["split"].nunique() > 1).sum()) == 170
    assert not table[["Bacterial Pneumonia", "Viral Pneumonia"]].isna().any().any()

    summary = summarise(config, check_images=False)
    assert summary["images"] == 5808 and summary["patients"] == 3102 and summary["refused"] is None
    assert summary["positives"] == {"Pneumonia": 4237, "Bacterial Pneumonia": 2752, "Viral Pneumonia": 1485}
    assert summary["negatives"]["Pneumonia"] == 1571
    moved = [p for p in summary["problems"] if "170 patient(s)" in p]
    assert len(moved) == 1 and "moved" in moved[0]
    test_files = {Path(p).name for p in table["path"][table["split"] == "test"]}
    site = load_site(config, check_images=False)
    assert {Path(p).name for p in site.split_table("test")["path"]} <= test_files  # the test split stays pure
    assert site.table.groupby("patient")["split"].nunique().max() == 1
    assert summary["splits"]["val"] > 0 and summary["splits"]["test"] == 301 and sum(summary["splits"].values()) == 5808
    assert "317 image(s)" in moved[0]  # site_configs/README.md: 317 of 618 test images move to train


def test_hannover_counts_match_its_readme_with_every_image_decoded(real: Path) -> None:
    # issue 41 (c): data/real/hannover_mhh_covid/README.md; decodes all 243 images
    summary = summarise(REPO / "site_configs" / "real" / "hannover_mhh_covid.yaml", check_images=True)
    assert (summary["images"], summary["patients"], summary["skipped"]) == (243, 71, 0)
    assert summary["positives"] == {"COVID-19": 243, "ICU admission": 186}
    assert summary["negatives"] == {"COVID-19": 0, "ICU admission": 57}
    assert summary["one_sided"] == {"COVID-19": 1.0} and summary["refused"] is None
    assert [p for p in summary["problems"] if "'COVID-19' has no negative image" in p]
    site = load_site(REPO / "site_configs" / "real" / "hannover_mhh_covid.yaml", check_images=False)
    assert site.table.loc[site.table["ICU admission"] == 1, "patient"].nunique() == 29
