"""Canonical label names, synonyms and harmonisation (cxrfl.data.labels)."""

from __future__ import annotations

import pytest
from cxrfl.data.labels import (
    CHEXPERT_CLASSES,
    KNOWN_CLASSES,
    NIH_CLASSES,
    NIH_COLUMN_NAMES,
    NO_FINDING,
    LabelConflictError,
    UnknownLabelError,
    canonical_name,
    harmonise,
    union_classes,
)


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        ("Effusion", "Pleural Effusion"),
        ("effusion", "Pleural Effusion"),
        ("Pleural_Thickening", "Pleural Thickening"),
        ("pleural-thickening", "Pleural Thickening"),
        ("Infiltrate", "Infiltration"),
        ("Infiltrates", "Infiltration"),
        ("  CARDIOMEGALY ", "Cardiomegaly"),
        ("lung_opacity", "Lung Opacity"),
        ("Enlarged  Cardiomediastinum", "Enlarged Cardiomediastinum"),
        ("No_Finding", NO_FINDING),
    ],
)
def test_synonyms_case_and_underscores(written: str, canonical: str) -> None:
    assert canonical_name(written) == canonical


def test_nih_spellings_map_to_the_14_canonical_classes() -> None:
    assert [canonical_name(n) for n in NIH_COLUMN_NAMES] == list(NIH_COLUMN_NAMES.values())
    assert sorted(NIH_COLUMN_NAMES.values()) == sorted(NIH_CLASSES)
    assert len(NIH_CLASSES) == 14 and len(CHEXPERT_CLASSES) == 13


def test_union_of_nih_and_chexpert_is_20_classes_with_7_shared() -> None:
    shared = set(NIH_CLASSES) & set(CHEXPERT_CLASSES)
    assert shared == {
        "Atelectasis",
        "Cardiomegaly",
        "Consolidation",
        "Edema",
        "Pleural Effusion",
        "Pneumonia",
        "Pneumothorax",
    }
    union = union_classes(NIH_CLASSES, CHEXPERT_CLASSES)
    assert len(union) == 20 and union == sorted(union) and tuple(union) == KNOWN_CLASSES


def test_unknown_label_names_close_matches_and_how_to_fix() -> None:
    with pytest.raises(UnknownLabelError) as info:
        canonical_name("Cardiomegally")
    message = str(info.value)
    assert "'Cardiomegally'" in message and "Cardiomegaly" in message and "label_map" in message


def test_harmonise_label_map_and_new_classes() -> None:
    mapping = harmonise(["Effusion", "opacity", "Tuberculosis"], {"opacity": "Lung Opacity", "Tuberculosis": "TB"})
    assert mapping == {"Effusion": "Pleural Effusion", "opacity": "Lung Opacity", "Tuberculosis": "TB"}
    assert harmonise(["My Sign"], extra=["My Sign"]) == {"My Sign": "My Sign"}


def test_harmonise_rejects_two_columns_for_one_class() -> None:
    with pytest.raises(UnknownLabelError, match="'Effusion' and 'Pleural Effusion' both mean 'Pleural Effusion'"):
        harmonise(["Effusion", "Pleural Effusion"])


def test_a_conflict_names_both_labels_and_a_fix_that_keeps_the_class() -> None:
    with pytest.raises(LabelConflictError) as info:
        harmonise(["Mass", "Infiltration", "Pneumonia"], {"Infiltration": "Pneumonia"}, kind="findings")
    error = info.value
    assert (error.first, error.second, error.label) == ("Infiltration", "Pneumonia", "Pneumonia")
    assert str(error) == (
        "findings 'Infiltration' and 'Pneumonia' both mean 'Pneumonia'; keep one of them: "
        "drop: ['Pneumonia'] in the site config keeps 'Infiltration' as 'Pneumonia'."
    )
    assert harmonise(["Mass", "Infiltration"], {"Infiltration": "Pneumonia"}) == {
        "Mass": "Mass",
        "Infiltration": "Pneumonia",
    }
