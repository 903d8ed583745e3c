"""Label readers on small files written in the exact published formats (CheXpert, MIMIC-CXR-JPG,
NIH, generic CSV), and their error messages."""

from __future__ import annotations

import ast
import csv
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cxrfl.data.labels import CHEXPERT_CLASSES, NIH_CLASSES
from cxrfl.data.readers import read_labels
from cxrfl.data.site import load_site
from cxrfl.data.site_config import SiteConfig, site_config_from_dict
from cxrfl.errors import ConfigError, DataError
from PIL import Image

CHEXPERT_HEADER = [
    "Path",
    "Sex",
    "Age",
    "Frontal/Lateral",
    "AP/PA",
    "No Finding",
    "Enlarged Cardiomediastinum",
    "Cardiomegaly",
    "Lung Opacity",
    "Lung Lesion",
    "Edema",
    "Consolidation",
    "Pneumonia",
    "Atelectasis",
    "Pneumothorax",
    "Pleural Effusion",
    "Pleural Other",
    "Fracture",
    "Support Devices",
]
MIMIC_LABELS_HEADER = [
    "subject_id",
    "study_id",
    "Atelectasis",
    "Cardiomegaly",
    "Consolidation",
    "Edema",
    "Enlarged Cardiomediastinum",
    "Fracture",
    "Lung Lesion",
    "Lung Opacity",
    "No Finding",
    "Pleural Effusion",
    "Pleural Other",
    "Pneumonia",
    "Pneumothorax",
    "Support Devices",
]
MIMIC_META_HEADER = [
    "dicom_id",
    "subject_id",
    "study_id",
    "PerformedProcedureStepDescription",
    "ViewPosition",
    "Rows",
    "Columns",
    "StudyDate",
    "StudyTime",
    "ProcedureCodeSequence_CodeMeaning",
    "ViewCodeSequence_CodeMeaning",
    "PatientOrientationCodeSequence_CodeMeaning",
]
NIH_HEADER = (
    "Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position,"
    "OriginalImage[Width,Height],OriginalImagePixelSpacing[x,y]"
)


def config(dataset: dict[str, Any], **top: Any) -> SiteConfig:
    return site_config_from_dict(
        {"site": "s", "dataset": {k: str(v) if isinstance(v, Path) else v for k, v in dataset.items()}, **top}
    )


def write_rows(path: Path, header: list[str], rows: list[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_image(path: Path, value: int = 100) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8), value, dtype=np.uint8)).save(path)


def nan_equal(values: list[float], expected: list[float]) -> bool:
    return len(values) == len(expected) and all(
        (math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(values, expected)
    )


# ---------------------------------------------------------------- CheXpert

CHEXPERT_ROWS = [
    # path, view, AP/PA, Cardiomegaly, Edema
    ("patient00001/study1/view1_frontal.jpg", "Frontal", "AP", "1.0", ""),
    ("patient00001/study1/view2_lateral.jpg", "Lateral", "", "1.0", ""),
    ("patient00002/study1/view1_frontal.jpg", "Frontal", "PA", "-1.0", "0.0"),
    ("patient00003/study2/view1_frontal.jpg", "Frontal", "AP", "", "-1.0"),
]


@pytest.fixture
def chexpert(tmp_path: Path) -> Path:
    """A CheXpert-v1.0-small layout: tmp/CheXpert-v1.0-small/{train.csv,train/patient.../...jpg}."""
    root = tmp_path / "CheXpert-v1.0-small"
    rows = []
    for rel, view, appa, cardio, edema in CHEXPERT_ROWS:
        write_image(root / "train" / rel)
        rows.append(
            {
                "Path": f"CheXpert-v1.0-small/train/{rel}",
                "Sex": "Female",
                "Age": "60",
                "Frontal/Lateral": view,
                "AP/PA": appa,
                "Cardiomegaly": cardio,
                "Edema": edema,
            }
        )
    rows[0]["No Finding"] = ""
    rows[2]["No Finding"] = "1.0"
    write_rows(root / "train.csv", CHEXPERT_HEADER, rows)
    return root


@pytest.mark.parametrize(
    ("policy", "cardiomegaly", "edema"),
    [
        ("zeros", [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]),
        ("ones", [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]),
        ("ignore", [1.0, math.nan, 0.0], [0.0, 0.0, math.nan]),
    ],
)
def test_chexpert_uncertain_policies_blank_is_negative(
    chexpert: Path, policy: str, cardiomegaly: list, edema: list
) -> None:
    table = read_labels(
        config({"format": "chexpert", "labels": chexpert / "train.csv", "images": chexpert, "uncertain": policy})
    )
    assert nan_equal(table["Cardiomegaly"].tolist(), cardiomegaly)
    assert nan_equal(table["Edema"].tolist(), edema)
    # every other class is blank in the file: not mentioned = negative, never unknown
    assert (table["Fracture"] == 0.0).all()


def test_chexpert_frontal_only_patients_classes_and_archive_folder(chexpert: Path) -> None:
    for images in (chexpert, chexpert.parent):  # the archive folder itself, or its parent
        table = read_labels(config({"format": "chexpert", "labels": chexpert / "train.csv", "images": images}))
        assert list(table.columns) == ["path", "patient", *CHEXPERT_CLASSES, "sex", "age", "view"]
        assert table["patient"].tolist() == ["patient00001", "patient00002", "patient00003"]
        expected = [str(chexpert / "train" / r[0]) for r in CHEXPERT_ROWS if r[1] == "Frontal"]
        assert table["path"].tolist() == expected
        assert all(Path(p).is_file() for p in table["path"])
    renamed = chexpert.rename(chexpert.parent / "chexpert_small")  # users rename folders too
    table = read_labels(config({"format": "chexpert", "labels": renamed / "train.csv", "images": renamed}))
    assert all(Path(p).is_file() for p in table["path"])


def test_chexpert_views_and_class_subset(chexpert: Path) -> None:
    cfg = config(
        {"format": "chexpert", "labels": chexpert / "train.csv", "images": chexpert, "views": ["pa"]},
        classes=["Edema", "cardiomegaly"],
    )
    table = read_labels(cfg)
    assert table["patient"].tolist() == ["patient00002"]
    assert list(table.columns) == ["path", "patient", "Edema", "Cardiomegaly", "sex", "age", "view"]


def test_chexpert_bad_value_names_file_line_and_column(chexpert: Path) -> None:
    text = (chexpert / "train.csv").read_text().splitlines()
    text[4] = text[4].replace("-1.0", "2")  # line 5 of the file: patient00003's Edema
    (chexpert / "train.csv").write_text("\n".join(text) + "\n")
    with pytest.raises(DataError) as info:
        read_labels(config({"format": "chexpert", "labels": chexpert / "train.csv", "images": chexpert}))
    message = str(info.value)
    assert str(chexpert / "train.csv") in message and "line 5" in message and "'Edema'" in message and "'2'" in message


def test_chexpert_path_without_patient_folder(chexpert: Path) -> None:
    rows = [{"Path": "CheXpert-v1.0-small/train/p1/study1/view1_frontal.jpg", "Frontal/Lateral": "Frontal"}]
    labels = write_rows(chexpert / "odd.csv", CHEXPERT_HEADER, rows)
    with pytest.raises(DataError, match=r"odd\.csv, line 2, column 'Path': no 'patientNNNNN' folder"):
        read_labels(config({"format": "chexpert", "labels": labels, "images": chexpert}))


# ---------------------------------------------------------------- MIMIC-CXR-JPG

MIMIC_IMAGES = [
    # dicom_id, subject, study, view
    ("d1-pa", "10000032", "50414267", "PA"),
    ("d2-ap", "10000032", "50414267", "AP"),
    ("d3-lat", "10000032", "50414267", "LATERAL"),
    ("d4-pa", "10000032", "53189527", "PA"),
    ("d5-ap", "10000764", "57375967", "AP"),
    ("d6-ll", "10000898", "50771383", "LL"),  # a study with a lateral image only
    ("d7-pa", "10000935", "51178377", "PA"),  # an image whose study has no label row
]


@pytest.fixture
def mimic(tmp_path: Path) -> Path:
    root = tmp_path / "mimic-cxr-jpg"
    for dicom, subject, study, _ in MIMIC_IMAGES:
        write_image(root / "files" / f"p{subject[:2]}" / f"p{subject}" / f"s{study}" / f"{dicom}.jpg")
    write_rows(
        root / "mimic-cxr-2.0.0-metadata.csv",
        MIMIC_META_HEADER,
        [
            {"dicom_id": d, "subject_id": s, "study_id": t, "ViewPosition": v, "Rows": "8", "Columns": "8"}
            for d, s, t, v in MIMIC_IMAGES
        ],
    )
    write_rows(
        root / "mimic-cxr-2.0.0-chexpert.csv",
        MIMIC_LABELS_HEADER,
        [
            {"subject_id": "10000032", "study_id": "50414267", "Cardiomegaly": "1.0", "Edema": "-1.0"},
            {"subject_id": "10000032", "study_id": "53189527", "Pleural Effusion": "1.0", "Edema": "0.0"},
            {"subject_id": "10000764", "study_id": "57375967", "Cardiomegaly": "0.0", "No Finding": "1.0"},
            {"subject_id": "10000898", "study_id": "50771383", "Fracture": "1.0"},
        ],
    )
    write_rows(
        root / "mimic-cxr-2.0.0-split.csv",
        ["dicom_id", "study_id", "subject_id", "split"],
        [
            {"dicom_id": d, "study_id": t, "subject_id": s, "split": {"10000764": "validate"}.get(s, "train")}
            for d, s, t, _ in MIMIC_IMAGES
        ],
    )
    return root


def mimic_config(root: Path, **dataset: Any) -> SiteConfig:
    return config(
        {
            "format": "mimic",
            "labels": root / "mimic-cxr-2.0.0-chexpert.csv",
            "metadata": root / "mimic-cxr-2.0.0-metadata.csv",
            "images": root,
            **dataset,
        }
    )


def test_mimic_joins_study_labels_to_frontal_images(mimic: Path) -> None:
    table = read_labels(mimic_config(mimic, uncertain="ignore"))
    assert sorted(CHEXPERT_CLASSES) == sorted(table.columns[2:-1]) and table.columns[-1] == "view"
    by_name = table.set_index(table["path"].map(lambda p: Path(p).stem))
    assert sorted(by_name.index) == ["d1-pa", "d2-ap", "d4-pa", "d5-ap"]  # both frontal images of one study
    assert by_name.loc["d1-pa", "Cardiomegaly"] == 1.0 and by_name.loc["d2-ap", "Cardiomegaly"] == 1.0
    assert math.isnan(by_name.loc["d2-ap", "Edema"]) and by_name.loc["d4-pa", "Edema"] == 0.0
    assert by_name.loc["d4-pa", "Pleural Effusion"] == 1.0 and by_name.loc["d4-pa", "Cardiomegaly"] == 0.0
    assert by_name.loc["d5-ap", "patient"] == "10000764"
    assert by_name.loc["d1-pa", "path"] == str(mimic / "files/p10/p10000032/s50414267/d1-pa.jpg")
    assert all(Path(p).is_file() for p in table["path"])
    assert any("1 image(s)" in p and "without a row" in p for p in table.attrs["problems"])
    files_root = read_labels(mimic_config(mimic, images=mimic / "files"))  # the files/ folder itself
    assert sorted(files_root["path"]) == sorted(table["path"])


def test_mimic_views_and_uncertain_zeros(mimic: Path) -> None:
    table = read_labels(mimic_config(mimic, views=["AP"]))
    assert sorted(Path(p).stem for p in table["path"]) == ["d2-ap", "d5-ap"]
    assert table["Edema"].tolist() == [0.0, 0.0]


def test_mimic_split_file_maps_validate_to_val(mimic: Path) -> None:
    site = load_site(mimic_config(mimic, split_file=mimic / "mimic-cxr-2.0.0-split.csv"))
    assert dict(zip(site.table["patient"], site.table["split"])) == {"10000032": "train", "10000764": "val"}
    assert site.skipped == []


def test_mimic_split_file_with_a_patient_in_two_splits(mimic: Path) -> None:
    split = mimic / "mimic-cxr-2.0.0-split.csv"
    split.write_text(split.read_text().replace("d4-pa,53189527,10000032,train", "d4-pa,53189527,10000032,test"))
    with pytest.raises(DataError) as info:
        load_site(mimic_config(mimic, split_file=split))
    message = str(info.value)
    assert str(split) in message and "10000032 in test/train" in message


def test_mimic_needs_metadata(mimic: Path) -> None:
    with pytest.raises(ConfigError, match="dataset.metadata"):
        read_labels(config({"format": "mimic", "labels": mimic / "mimic-cxr-2.0.0-chexpert.csv", "images": mimic}))


# ---------------------------------------------------------------- NIH (small files)


def write_nih(path: Path, rows: list[str]) -> Path:
    path.write_text(NIH_HEADER + "\n" + "\n".join(rows) + "\n")
    return path


def test_nih_rows_wider_than_the_header(tmp_path: Path) -> None:
    labels = write_nih(
        tmp_path / "Data_Entry_2017.csv",
        [
            "00000001_000.png,Cardiomegaly|Effusion,0,1,57,M,PA,2682,2749,0.143,0.143",
            "00000001_001.png,No Finding,1,1,58,M,AP,2894,2729,0.143,0.143,",  # the 2017 file's trailing comma
            "00000002_000.png,Pleural_Thickening,0,2,81,M,PA,2500,2048,0.168,0.168",
        ],
    )
    table = read_labels(config({"format": "nih", "labels": labels, "images": tmp_path / "images"}))
    assert list(table.columns) == ["path", "patient", *NIH_CLASSES, "sex", "age", "view"]
    assert table["patient"].tolist() == ["1", "1", "2"]
    assert table["path"].tolist() == [
        str(tmp_path / "images" / f) for f in ("00000001_000.png", "00000001_001.png", "00000002_000.png")
    ]
    positives = {c: table[c].tolist() for c in ("Cardiomegaly", "Pleural Effusion", "Pleural Thickening")}
    assert positives == {"Cardiomegaly": [1, 0, 0], "Pleural Effusion": [1, 0, 0], "Pleural Thickening": [0, 0, 1]}
    assert table[list(NIH_CLASSES)].notna().all().all()  # NIH labels are complete
    pa = read_labels(config({"format": "nih", "labels": labels, "images": tmp_path, "views": ["PA"]}))
    assert len(pa) == 2


def test_nih_unknown_finding_names_file_line_and_fix(tmp_path: Path) -> None:
    labels = write_nih(
        tmp_path / "d.csv",
        [
            "a.png,Mass,0,1,57,M,PA,1,1,0.1,0.1",
            "b.png,Mass|Lung Cyst,0,2,57,M,PA,1,1,0.1,0.1",
        ],
    )
    with pytest.raises(DataError) as info:
        read_labels(config({"format": "nih", "labels": labels, "images": tmp_path}))
    message = str(info.value)
    assert str(labels) in message and "line 3" in message and "'Lung Cyst'" in message and "label_map" in message
    mapped = read_labels(
        config({"format": "nih", "labels": labels, "images": tmp_path}, label_map={"Lung Cyst": "Cyst"})
    )
    assert mapped["Cyst"].tolist() == [0.0, 1.0] and len(mapped.columns) == 2 + 15 + 3
    dropped = read_labels(config({"format": "nih", "labels": labels, "images": tmp_path}, drop=["Lung Cyst"]))
    assert list(dropped.columns[2:-3]) == list(NIH_CLASSES)


# ---------------------------------------------------------------- generic CSV


def test_generic_csv_columns_blank_unknown_and_harmonised(tmp_path: Path) -> None:
    labels = write_rows(
        tmp_path / "labels.csv",
        ["file", "pid", "set", "Effusion", "Pleural_Thickening", "opacity", "comment"],
        [
            {
                "file": "a.png",
                "pid": "p1",
                "set": "train",
                "Effusion": "1",
                "Pleural_Thickening": "0",
                "opacity": "",
                "comment": "ok",
            },
            {
                "file": "sub/b.png",
                "pid": "p2",
                "set": "Validation",
                "Effusion": "0",
                "Pleural_Thickening": "NaN",
                "opacity": "1",
                "comment": "",
            },
        ],
    )
    cfg = config(
        {
            "format": "csv",
            "labels": labels,
            "images": tmp_path / "img",
            "path_column": "file",
            "patient_column": "pid",
            "split_column": "set",
        },
        label_map={"opacity": "Lung Opacity"},
        drop=["comment"],
    )
    table = read_labels(cfg)
    assert list(table.columns) == ["path", "patient", "split", "Pleural Effusion", "Pleural Thickening", "Lung Opacity"]
    assert table["path"].tolist() == [str(tmp_path / "img/a.png"), str(tmp_path / "img/sub/b.png")]
    assert table["split"].tolist() == ["train", "val"] and table["patient"].tolist() == ["p1", "p2"]
    assert nan_equal(table["Lung Opacity"].tolist(), [math.nan, 1.0])
    assert nan_equal(table["Pleural Thickening"].tolist(), [0.0, math.nan])
    one_each = read_labels(
        config(
            {"format": "csv", "labels": labels, "images": tmp_path, "path_column": "file"},
            drop=["comment", "pid", "set"],
            label_map={"opacity": "Lung Opacity"},
        )
    )
    assert one_each["patient"].tolist() == ["a.png", "sub/b.png"] and "split" not in one_each


def test_unknown_label_column_names_file_and_column(tmp_path: Path) -> None:
    labels = write_rows(
        tmp_path / "labels.csv",
        ["path", "Cardiomegaly", "Lung Cyst"],
        [{"path": "a.png", "Cardiomegaly": "1", "Lung Cyst": "0"}],
    )
    with pytest.raises(DataError) as info:
        read_labels(config({"format": "csv", "labels": labels, "images": tmp_path}))
    assert str(labels) in str(info.value) and "'Lung Cyst'" in str(info.value)


def test_duplicate_label_columns_are_an_error(tmp_path: Path) -> None:
    labels = write_rows(
        tmp_path / "labels.csv",
        ["path", "Effusion", "Pleural Effusion"],
        [{"path": "a.png", "Effusion": "1", "Pleural Effusion": "1"}],
    )
    with pytest.raises(DataError) as info:
        read_labels(config({"format": "csv", "labels": labels, "images": tmp_path}))
    assert str(labels) in str(info.value) and "both mean 'Pleural Effusion'" in str(info.value)
    fixed = read_labels(config({"format": "csv", "labels": labels, "images": tmp_path}, drop=["Effusion"]))
    assert list(fixed.columns) == ["path", "patient", "Pleural Effusion"]


def test_classes_not_in_the_file_name_the_available_ones(tmp_path: Path) -> None:
    labels = write_rows(tmp_path / "labels.csv", ["path", "Mass", "Nodule"], [{"path": "a.png", "Mass": "1"}])
    with pytest.raises(ConfigError) as info:
        read_labels(config({"format": "csv", "labels": labels, "images": tmp_path}, classes=["Mass", "Hernia"]))
    message = str(info.value)
    assert "'Hernia'" in message and str(labels) in message and "'Mass', 'Nodule'" in message


def test_missing_empty_and_malformed_label_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    with pytest.raises(DataError, match=f"{missing} does not exist"):
        read_labels(config({"format": "nih", "labels": missing, "images": tmp_path}))
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(DataError, match=f"{empty} is empty"):
        read_labels(config({"format": "csv", "labels": empty, "images": tmp_path}))
    no_path = write_rows(tmp_path / "nopath.csv", ["image", "Mass"], [{"image": "a.png", "Mass": "1"}])
    with pytest.raises(DataError, match=r"nopath\.csv has no column\(s\) 'path'"):
        read_labels(config({"format": "csv", "labels": no_path, "images": tmp_path}))
    binary = tmp_path / "labels.csv"
    binary.write_bytes(b"\xff\xfe\x00\x81\x00garbage\x00\n\x00\xff")
    with pytest.raises(DataError, match=str(binary)):
        read_labels(config({"format": "csv", "labels": binary, "images": tmp_path}))
    bad_split = write_rows(
        tmp_path / "split.csv",
        ["path", "split", "Mass"],
        [{"path": "a.png", "split": "train", "Mass": "1"}, {"path": "b.png", "split": "hold-out", "Mass": "0"}],
    )
    with pytest.raises(DataError, match=r"split\.csv, line 3, column 'split': split 'hold-out'"):
        read_labels(config({"format": "csv", "labels": bad_split, "images": tmp_path, "split_column": "split"}))


# ---------------------------------------------------------------- label spelling variants and conflicts (NIH, CSV)


def follow_advice(message: str) -> list[str]:
    """The ``drop: [...]`` an error message tells the user to write."""
    match = re.search(r"drop: (\[[^\]]*\])", message)
    assert match, f"no drop advice in {message!r}"
    return ast.literal_eval(match.group(1))


def test_nih_variants_of_a_known_finding_are_read_as_it_with_one_warning(tmp_path: Path) -> None:
    labels = write_nih(
        tmp_path / "d.csv",
        [
            "a.png,Effusion,0,1,57,M,PA,1,1,0.1,0.1",
            "b.png,effusion|Mass,0,2,57,M,PA,1,1,0.1,0.1",
            "c.png,Pleural Effusion,0,3,57,M,PA,1,1,0.1,0.1",
            "d.png,CARDIOMEGALY|pleural thickening,0,4,57,M,PA,1,1,0.1,0.1",
            "e.png,no finding,0,5,57,M,PA,1,1,0.1,0.1",
            "f.png,Infiltrate|effusion,0,6,57,M,PA,1,1,0.1,0.1",
        ],
    )
    table = read_labels(config({"format": "nih", "labels": labels, "images": tmp_path}))
    assert list(table.columns[2:-3]) == list(NIH_CLASSES)  # no extra class, no conflict
    expected = {
        "Pleural Effusion": [1, 1, 1, 0, 0, 1],
        "Mass": [0, 1, 0, 0, 0, 0],
        "Cardiomegaly": [0, 0, 0, 1, 0, 0],
        "Pleural Thickening": [0, 0, 0, 1, 0, 0],
        "Infiltration": [0, 0, 0, 0, 0, 1],
    }
    assert {c: table[c].tolist() for c in expected} == expected
    assert table[list(NIH_CLASSES)].sum(axis=1).tolist() == [1, 2, 1, 2, 0, 2]
    [warning] = table.attrs["problems"]
    assert warning.startswith(f"{labels}: 5 row(s) spell a finding of 'Finding Labels' differently")
    for part in (
        "'effusion' as 'Effusion' (2 row(s), line(s) 3, 7)",
        "'Pleural Effusion' as 'Effusion' (1 row(s), line(s) 4)",
        "'CARDIOMEGALY' as 'Cardiomegaly'",
        "'pleural thickening' as 'Pleural_Thickening'",
        "'no finding' as 'No Finding' (1 row(s), line(s) 6)",
        "'Infiltrate' as 'Infiltration'",
    ):
        assert part in warning


def test_real_nih_file_with_variant_spellings_reads_the_same_labels(shared_data: Path, tmp_path: Path) -> None:
    source = shared_data / "nih1000" / "Data_Entry_2017_v2020.csv"
    lines = source.read_text().splitlines()
    variants = ["effusion", "Pleural Effusion", "EFFUSION", "pleural_effusion"]
    changed = []
    for i, line in enumerate(lines[1:], start=2):
        name, labels, rest = line.split(",", 2)
        if "Effusion" in labels.split("|") and len(changed) < 40:
            labels = labels.replace("Effusion", variants[len(changed) % 4])
            changed.append(i)
        lines[i - 1] = f"{name},{labels},{rest}"
    (tmp_path / "variants.csv").write_text("\n".join(lines) + "\n")
    original = read_labels(config({"format": "nih", "labels": source, "images": tmp_path}))
    rewritten = read_labels(config({"format": "nih", "labels": tmp_path / "variants.csv", "images": tmp_path}))
    assert len(changed) == 40 and original.equals(rewritten)
    [warning] = rewritten.attrs["problems"]
    assert "40 row(s)" in warning and f"line(s) {changed[0]}, " in warning
    assert original.attrs["problems"] == []


def test_nih_findings_that_label_map_merges_name_the_line_and_the_advice_keeps_the_class(tmp_path: Path) -> None:
    labels = write_nih(
        tmp_path / "d.csv",
        [
            "a.png,Infiltration,0,1,57,M,PA,1,1,0.1,0.1",
            "b.png,Mass,0,2,57,M,PA,1,1,0.1,0.1",
            "c.png,Pneumonia|Mass,0,3,57,M,PA,1,1,0.1,0.1",
        ],
    )
    dataset = {"format": "nih", "labels": labels, "images": tmp_path}
    with pytest.raises(DataError) as info:
        read_labels(config(dataset, label_map={"Infiltration": "Pneumonia"}))
    message = str(info.value)
    assert (
        message.startswith(
            f"{labels}, line 4, column 'Finding Labels': findings 'Infiltration' and 'Pneumonia' both mean 'Pneumonia'"
        )
        and "label columns" not in message
        and "\n" not in message
    )
    fixed = read_labels(config(dataset, label_map={"Infiltration": "Pneumonia"}, drop=follow_advice(message)))
    assert "Pneumonia" in fixed.columns and "Infiltration" not in fixed.columns
    assert fixed["Pneumonia"].tolist() == [1.0, 0.0, 0.0]  # Infiltration's rows: the advice dropped 'Pneumonia'
    assert fixed.attrs["problems"] == []


@pytest.mark.parametrize("second", ["Pleural Effusion", "effusion"])
def test_two_csv_columns_for_one_class_name_the_header_and_the_advice_keeps_the_class(
    tmp_path: Path, second: str
) -> None:
    labels = write_rows(
        tmp_path / "labels.csv",
        ["path", "Effusion", second, "Mass"],
        [
            {"path": "a.png", "Effusion": "1", second: "0", "Mass": "0"},
            {"path": "b.png", "Effusion": "0", second: "1", "Mass": "1"},
        ],
    )
    dataset = {"format": "csv", "labels": labels, "images": tmp_path}
    with pytest.raises(DataError) as info:
        read_labels(config(dataset))
    message = str(info.value)
    assert message.startswith(
        f"{labels}, line 1 (the header): label columns 'Effusion' and {second!r} both mean 'Pleural Effusion'"
    )
    assert follow_advice(message) == [second]
    fixed = read_labels(config(dataset, drop=follow_advice(message)))
    assert list(fixed.columns) == ["path", "patient", "Pleural Effusion", "Mass"]
    assert fixed["Pleural Effusion"].tolist() == [1.0, 0.0]  # the 'Effusion' column, kept
    assert fixed.attrs["problems"] == []


def test_a_drop_that_removes_a_class_by_another_spelling_says_so(tmp_path: Path) -> None:
    labels = write_nih(tmp_path / "d.csv", ["a.png,effusion|Mass,0,1,57,M,PA,1,1,0.1,0.1"])
    table = read_labels(config({"format": "nih", "labels": labels, "images": tmp_path}, drop=["effusion", "Cyst"]))
    assert "Pleural Effusion" not in table.columns and table["Mass"].tolist() == [1.0]
    variants, removed, unmatched = table.attrs["problems"]
    assert "'effusion' as 'Effusion'" in variants
    assert removed == f"drop 'effusion' removed label(s) 'Effusion' of {labels} (class 'Pleural Effusion')"
    assert unmatched == f"drop 'Cyst' matches no label of {labels}"


# ---------------------------------------------------------------- Windows paths (generic CSV)


def test_generic_csv_accepts_windows_separators(tmp_path: Path) -> None:
    write_image(tmp_path / "img" / "a.png")
    write_image(tmp_path / "img" / "ward 3" / "b.png", 50)
    labels = write_rows(
        tmp_path / "labels.csv",
        ["path", "Mass"],
        [{"path": "a.png", "Mass": "1"}, {"path": "ward 3\\b.png", "Mass": "0"}],
    )
    splits = write_rows(
        tmp_path / "split.csv",
        ["path", "split"],
        [{"path": "a.png", "split": "train"}, {"path": "ward 3\\b.png", "split": "test"}],
    )
    cfg = config({"format": "csv", "labels": labels, "images": tmp_path / "img", "split_file": splits})
    data = load_site(cfg)
    assert data.table["path"].tolist() == [str(tmp_path / "img" / "a.png"), str(tmp_path / "img" / "ward 3" / "b.png")]
    assert data.skipped == [] and data.table["split"].tolist() == ["train", "test"]
