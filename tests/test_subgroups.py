"""Subgroup fields (issue 45 point 4): sex, age and view read beside the labels into a site's table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import require_data
from cxrfl.data.labels import NIH_CLASSES
from cxrfl.data.readers import read_labels
from cxrfl.data.site import load_site
from cxrfl.data.site_config import SiteConfig, site_config_from_dict
from cxrfl.data.subgroups import SUBGROUP_FIELDS, subgroup_frame
from cxrfl.data.summary import format_summary, summarise
from cxrfl.errors import ConfigError, DataError
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
HANNOVER = REPO.parent / "shared" / "data" / "real" / "hannover_mhh_covid"
NIH_FINDINGS = {"Effusion": "Pleural Effusion", "Pleural_Thickening": "Pleural Thickening"}

# a generic CSV with good and bad subgroup values: (file, gender, years, proj) -> (sex, age, view) expected
ROWS = [
    ("a.png", "F", "57", "pa", "F", 57.0, "PA"),
    ("b.png", "male", "058Y", "Lateral", "M", 58.0, "LL"),
    ("c.png", "w", "006M", " ap ", "F", 0.5, "AP"),
    ("d.png", "x", "abc", "", None, None, None),
    ("e.png", "", "150", "PA", None, None, "PA"),
    ("f.png", "Female", "010D", "pa", "F", 10 / 365.25, "PA"),
    ("g.png", "M", "57.0", "AP", "M", 57.0, "AP"),
]


def config(dataset: dict[str, Any], **top: Any) -> SiteConfig:
    return site_config_from_dict(
        {"site": "s", "dataset": {k: str(v) if isinstance(v, Path) else v for k, v in dataset.items()}, **top}
    )


@pytest.fixture
def csv_site(tmp_path: Path) -> Path:
    """A generic CSV of ROWS (one image each, one patient per two images) with its images."""
    lines = ["file,patient,Cardiomegaly,gender,years,proj"]
    for i, (name, gender, years, proj, *_) in enumerate(ROWS):
        Image.fromarray(np.full((8, 8), 10 * i, dtype=np.uint8)).save(tmp_path / name)
        lines.append(f"{name},p{i // 2},{i % 2},{gender},{years},{proj}")
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    return tmp_path


def csv_config(root: Path, **subgroups: str) -> SiteConfig:
    dataset = {"format": "csv", "labels": root / "labels.csv", "images": root, "path_column": "file"}
    return config(
        {**dataset, "patient_column": "patient", "subgroups": subgroups},
        drop=[c for c in ("gender", "years", "proj") if c not in subgroups.values()],
        split={"train": 0.5, "val": 0.25, "test": 0.25},
    )


def by_image(table: pd.DataFrame) -> pd.DataFrame:
    return table.set_index(table["path"].map(lambda p: Path(p).name))


# ---------------------------------------------------------------- the real sets
def test_nih1000_subgroups_match_the_file_read_with_plain_pandas(shared_data: Path) -> None:
    labels = shared_data / "nih1000" / "Data_Entry_2017_v2020.csv"
    site = load_site(
        config({"format": "nih", "labels": labels, "images": shared_data / "nih1000" / "images"}), check_images=False
    )
    raw = pd.read_csv(labels, index_col=False).set_index("Image Index")
    table = by_image(site.table).loc[raw.index]
    assert list(site.table.columns[-3:]) == list(SUBGROUP_FIELDS)  # after the class columns
    assert table["sex"].value_counts().to_dict() == raw["Patient Gender"].value_counts().to_dict()
    assert (table["sex"] == raw["Patient Gender"]).all() and set(raw["Patient Gender"]) == {"F", "M"}
    assert (table["age"] == raw["Patient Age"].astype(float)).all()
    assert (table["view"] == raw["View Position"]).all() and set(raw["View Position"]) == {"PA", "AP"}
    findings = set(raw["Finding Labels"].str.split("|").explode()) - {"No Finding"}
    assert sorted(site.classes) == sorted(NIH_FINDINGS.get(f, f) for f in findings)
    assert not [p for p in site.problems if "column 'Patient" in p or "column 'View" in p]  # nothing unknown


def test_hannover_registry_subgroups_from_the_shipped_config() -> None:
    require_data(HANNOVER.is_dir(), f"real data not found at {HANNOVER} (the shared/ folder beside the checkout)")
    site = load_site(REPO / "site_configs" / "real" / "hannover_mhh_covid.yaml", check_images=False)
    raw = pd.read_csv(HANNOVER / "data.csv", dtype=str, keep_default_na=False).set_index("image_id")
    table = by_image(site.table).loc[[f"{i}.png" for i in raw.index]]
    assert site.classes == ["COVID-19", "ICU admission"]
    assert table["sex"].tolist() == raw["sex"].str.upper().tolist() and set(raw["sex"]) == {"m", "f"}
    assert table["view"].tolist() == raw["projection"].str.upper().tolist()
    assert (raw["age"] == "").all() and table["age"].isna().all()  # redacted upstream: blank, no warning
    assert not [p for p in site.problems if "column 'sex'" in p or "column 'age'" in p]


# ---------------------------------------------------------------- normalisation and warnings
def test_bad_values_become_unknown_with_one_warning_per_field(csv_site: Path) -> None:
    site = load_site(csv_config(csv_site, sex="gender", age="years", view="proj"))
    table = by_image(site.table).loc[[r[0] for r in ROWS]]
    assert [None if isinstance(v, float) else v for v in table["sex"]] == [r[4] for r in ROWS]
    assert [None if math.isnan(v) else v for v in table["age"]] == pytest.approx([r[5] for r in ROWS])
    assert [None if isinstance(v, float) else v for v in table["view"]] == [r[6] for r in ROWS]
    labels = csv_site / "labels.csv"
    sex = [p for p in site.problems if "column 'gender'" in p]
    age = [p for p in site.problems if "column 'years'" in p]
    assert len(sex) == 1 and str(labels) in sex[0] and "1 sex value(s)" in sex[0] and "'x'" in sex[0]
    assert len(age) == 1 and str(labels) in age[0] and "2 age value(s)" in age[0] and "'abc'" in age[0]
    assert not [p for p in site.problems if "column 'proj'" in p]  # any view is read; a blank is no problem


def test_chexpert_and_mimic_read_their_own_columns(tmp_path: Path) -> None:
    chexpert = tmp_path / "train.csv"
    chexpert.write_text(
        "Path,Sex,Age,Frontal/Lateral,AP/PA,Cardiomegaly\n"
        "CheXpert-v1.0-small/train/patient00001/study1/view1_frontal.jpg,Female,68,Frontal,AP,1.0\n"
        "CheXpert-v1.0-small/train/patient00001/study1/view2_lateral.jpg,Female,68,Lateral,,1.0\n"
        "CheXpert-v1.0-small/train/patient00002/study1/view1_frontal.jpg,Unknown,87,Frontal,PA,\n"
    )
    cfg = config({"format": "chexpert", "labels": chexpert, "images": tmp_path})
    table = read_labels(cfg)  # frontal images only
    assert table[["sex", "age", "view"]].fillna("?").values.tolist() == [["F", 68.0, "AP"], ["?", 87.0, "PA"]]
    assert [p for p in table.attrs["problems"] if "column 'Sex'" in p and "'Unknown'" in p]
    raw = pd.read_csv(chexpert, dtype=str, keep_default_na=False)
    assert subgroup_frame(raw, cfg, chexpert, [])["view"].tolist() == ["AP", "LL", "PA"]  # a lateral is LL
    (tmp_path / "labels.csv").write_text("subject_id,study_id,Cardiomegaly\n10,50,1.0\n")
    (tmp_path / "meta.csv").write_text(
        "dicom_id,subject_id,study_id,ViewPosition\nd1,10,50,PA\nd2,10,50,ap\nd3,10,50,LATERAL\n"
    )
    mimic = {"format": "mimic", "labels": tmp_path / "labels.csv", "metadata": tmp_path / "meta.csv"}
    assert read_labels(config({**mimic, "images": tmp_path}))["view"].tolist() == ["PA", "AP"]
    lateral = read_labels(config({**mimic, "images": tmp_path, "views": ["PA", "LATERAL"]}))
    assert lateral["view"].tolist() == ["PA", "LL"] and "sex" not in lateral and "age" not in lateral


def test_nih_file_without_the_columns_gives_no_subgroup_column(tmp_path: Path) -> None:
    labels = tmp_path / "d.csv"
    labels.write_text("Image Index,Finding Labels,Patient ID,View Position\na.png,Mass,1,PA\nb.png,No Finding,2,AP\n")
    table = read_labels(config({"format": "nih", "labels": labels, "images": tmp_path}))
    assert list(table.columns) == ["path", "patient", *NIH_CLASSES, "view"] and table.attrs["problems"] == []


# ---------------------------------------------------------------- configuration errors
def test_a_key_other_than_sex_age_view_is_refused(tmp_path: Path) -> None:
    dataset = {"format": "csv", "labels": tmp_path / "l.csv", "images": tmp_path}
    with pytest.raises(ConfigError) as info:
        config({**dataset, "subgroups": {"sex": "gender", "race": "r"}})
    assert str(info.value) == "dataset.subgroups has key(s) 'race'; allowed: sex, age, view (in the site config)"
    with pytest.raises(ConfigError, match="^dataset.subgroups is only read for format csv or categorical or registry"):
        config({"format": "nih", "labels": tmp_path / "l.csv", "images": tmp_path, "subgroups": {"sex": "s"}})


def test_a_configured_column_the_file_lacks_names_file_column_and_setting(csv_site: Path) -> None:
    with pytest.raises(DataError) as info:
        load_site(csv_config(csv_site, sex="gender", age="patient_age"), check_images=False)
    message = str(info.value)
    assert "\n" not in message and str(csv_site / "labels.csv") in message
    assert "'patient_age'" in message and "dataset.subgroups.age" in message


def test_classes_splits_and_labels_are_unchanged_by_the_subgroup_columns(csv_site: Path) -> None:
    # positive control: the same site read with and without subgroups has the same classes, labels and split
    plain = load_site(csv_config(csv_site))
    audited = load_site(csv_config(csv_site, sex="gender", age="years", view="proj"))
    assert plain.classes == audited.classes == ["Cardiomegaly"]
    assert not set(SUBGROUP_FIELDS) & set(plain.table.columns)
    assert list(audited.table.columns) == [*plain.table.columns, *SUBGROUP_FIELDS]
    assert plain.table.equals(audited.table[plain.table.columns])


# ---------------------------------------------------------------- cxrfl data summary
def test_summary_prints_one_subgroup_line(csv_site: Path, shared_data: Path) -> None:
    summary = summarise(csv_config(csv_site, sex="gender", age="years", view="proj"))
    assert summary["subgroups"]["sex"] == {"F": 3, "M": 2, "unknown": 2}
    ages = sorted(r[5] for r in ROWS if r[5] is not None)
    median = float(np.median(ages))
    assert summary["subgroups"]["age"] == {"median": median, "min": ages[0], "max": ages[-1], "unknown": 2}
    lines = [line for line in format_summary(summary).splitlines() if line.startswith("subgroups")]
    assert lines == [
        f"subgroups: sex F 3, M 2, unknown 2; age median {median:g} ({ages[0]:g}-{ages[-1]:g}), unknown 2; "
        "view PA 3, AP 2, LL 1, unknown 1"
    ]
    plain = format_summary(summarise(csv_config(csv_site)))
    assert "subgroups" not in plain
    raw = pd.read_csv(shared_data / "nih1000" / "Data_Entry_2017_v2020.csv", index_col=False)
    sex, view, age = raw["Patient Gender"].value_counts(), raw["View Position"].value_counts(), raw["Patient Age"]
    expected = (
        f"subgroups: sex F {sex['F']}, M {sex['M']}; age median {age.median():g} ({age.min()}-{age.max()}); "
        f"view PA {view['PA']}, AP {view['AP']}"
    )
    nih = format_summary(summarise(REPO / "site_configs" / "nih1000.yaml", check_images=False))
    assert expected in nih.splitlines()


def test_categorical_reads_its_configured_columns(tmp_path: Path) -> None:
    (tmp_path / "l.csv").write_text("file,finding,gender,proj\na.png,covid,f,ap\nb.png,normal,M,\n")
    dataset = {"format": "categorical", "labels": tmp_path / "l.csv", "images": tmp_path, "path_column": "file"}
    values = {"finding_column": "finding", "values": {"covid": "COVID-19", "normal": None}}
    table = read_labels(config({**dataset, **values, "subgroups": {"view": "proj", "sex": "gender"}}))
    assert list(table.columns[2:]) == ["COVID-19", "sex", "view"]  # field order, whatever the setting's order
    assert table["sex"].tolist() == ["F", "M"] and table["view"].fillna("?").tolist() == ["AP", "?"]
