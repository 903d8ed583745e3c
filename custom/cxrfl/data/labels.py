"""Canonical chest X-ray finding names and label harmonisation.

Every dataset names its findings a little differently (NIH ``Effusion`` is CheXpert
``Pleural Effusion``, NIH writes ``Pleural_Thickening``). All code in cxrfl works on the
canonical names defined here; readers map a dataset's column names through
:func:`canonical_name`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping

NO_FINDING = "No Finding"

NIH_CLASSES: tuple[str, ...] = (
    "Atelectasis",
    "Cardiomegaly",
    "Consolidation",
    "Edema",
    "Pleural Effusion",
    "Emphysema",
    "Fibrosis",
    "Hernia",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pleural Thickening",
    "Pneumonia",
    "Pneumothorax",
)
"""The 14 NIH ChestX-ray14 findings, canonical names (NIH ``Effusion`` = ``Pleural Effusion``)."""

NIH_COLUMN_NAMES: dict[str, str] = {
    "Atelectasis": "Atelectasis",
    "Cardiomegaly": "Cardiomegaly",
    "Consolidation": "Consolidation",
    "Edema": "Edema",
    "Effusion": "Pleural Effusion",
    "Emphysema": "Emphysema",
    "Fibrosis": "Fibrosis",
    "Hernia": "Hernia",
    "Infiltration": "Infiltration",
    "Mass": "Mass",
    "Nodule": "Nodule",
    "Pleural_Thickening": "Pleural Thickening",
    "Pneumonia": "Pneumonia",
    "Pneumothorax": "Pneumothorax",
}
"""NIH's own spelling (as in ``Finding Labels``) -> canonical name."""

CHEXPERT_CLASSES: tuple[str, ...] = (
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
)
"""The 13 CheXpert / MIMIC-CXR findings (``No Finding`` excluded), in the file's column order."""

KNOWN_CLASSES: tuple[str, ...] = tuple(sorted(set(NIH_CLASSES) | set(CHEXPERT_CLASSES)))
"""The 20-class union of NIH and CheXpert findings, sorted."""

_SYNONYMS: dict[str, str] = {
    "effusion": "Pleural Effusion",
    "pleural effusions": "Pleural Effusion",
    "infiltrate": "Infiltration",
    "infiltrates": "Infiltration",
    "pleural thickening": "Pleural Thickening",
    "enlarged cardiom": "Enlarged Cardiomediastinum",
    "lung lesions": "Lung Lesion",
    "support device": "Support Devices",
    "no findings": NO_FINDING,
}


class UnknownLabelError(ValueError):
    """A label name that is neither canonical, a known synonym, nor declared by the site."""


class LabelConflictError(UnknownLabelError):
    """Two label names of one file that mean the same class.

    Args:
        message: the one-line explanation with its fix.
        first: the name seen first.
        second: the name seen second (the one the fix drops).
        label: the class both mean.
    """

    def __init__(self, message: str, first: str, second: str, label: str) -> None:
        super().__init__(message)
        self.first, self.second, self.label = first, second, label


def normalise_key(name: str) -> str:
    """Lower-case, treat ``_``/``-`` as spaces and collapse white space.

    Args:
        name: a label name as written in some file.
    """
    return re.sub(r"\s+", " ", re.sub(r"[_\-]", " ", str(name))).strip().lower()


_LOOKUP: dict[str, str] = {normalise_key(c): c for c in (*KNOWN_CLASSES, NO_FINDING)}
_LOOKUP.update({normalise_key(k): v for k, v in _SYNONYMS.items()})


def canonical_name(name: str, extra: Iterable[str] = ()) -> str:
    """Map a label name to its canonical spelling.

    Args:
        name: the name as a dataset writes it (any case, ``_`` or spaces).
        extra: additional class names a site declares (kept as written).

    Raises:
        UnknownLabelError: the name is not known; the message suggests close matches.
    """
    key = normalise_key(name)
    extras = {normalise_key(e): str(e).strip() for e in extra}
    if key in extras:
        return extras[key]
    if key in _LOOKUP:
        return _LOOKUP[key]
    choices = sorted(set(_LOOKUP.values()) | set(extras.values()))
    close = difflib.get_close_matches(str(name), choices, n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise UnknownLabelError(
        f"unknown label {name!r}.{hint} Map it in the site config's label_map "
        f"(e.g. label_map: {{{name!r}: 'Some Finding'}}) or drop it (drop: [{name!r}])."
    )


def harmonise(
    names: Iterable[str],
    label_map: Mapping[str, str] | None = None,
    extra: Iterable[str] = (),
    kind: str = "label columns",
) -> dict[str, str]:
    """Map a dataset's label columns to canonical names.

    A ``label_map`` entry renames a column first; its target may be a canonical name, a
    synonym, or a new class name (a class only this site brings).

    Args:
        names: the column names as the file has them.
        label_map: site renames, file name -> target name.
        extra: further class names the site declares.
        kind: what the names are, for messages (``label columns``, ``findings ...``).

    Returns:
        file name -> canonical name, in the input order.

    Raises:
        UnknownLabelError: a name cannot be mapped.
        LabelConflictError: two names map to one class; the message's fix (``drop`` the
            second, written exactly as in the file) keeps the class.
    """
    label_map = dict(label_map or {})
    mapped_keys = {normalise_key(k): v for k, v in label_map.items()}
    extras = list(extra) + list(label_map.values())
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in names:
        target = mapped_keys.get(normalise_key(name), name)
        canon = canonical_name(target, extra=extras)
        if canon in seen:
            raise LabelConflictError(
                f"{kind} {seen[canon]!r} and {name!r} both mean {canon!r}; keep one of them: "
                f"drop: [{name!r}] in the site config keeps {seen[canon]!r} as {canon!r}.",
                seen[canon],
                name,
                canon,
            )
        seen[canon] = name
        out[name] = canon
    return out


def union_classes(*class_sets: Iterable[str]) -> list[str]:
    """The sorted union of several class lists (the global class order).

    Args:
        class_sets: each site's class names.
    """
    return sorted(set().union(*(set(c) for c in class_sets)))
