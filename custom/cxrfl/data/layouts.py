"""Native layouts of smaller public sets, read as published (no conversion script).

* ``folders``: one folder per class (``images/[<split>/]<class>/.../<file>``); the patient and
  sub-classes come from the file name by patterns. An image is positive for its folder's class and
  negative for every other class (a no-finding folder: negative for all). A sub-class of its folder
  is positive when its pattern matches the file name, negative when another sub-class of the
  folder matches, else not labelled (NaN); sub-classes of other folders are negative.
* ``categorical``: a CSV with one finding column: value -> class (that class 1, the others 0), a
  value meaning no finding (all 0), values meaning not labelled and blank cells (all NaN).
* ``registry``: a CSV of a registry of one disease: ``site_label`` holds for every image, each
  ``derived`` class is positive where its column is filled, else negative.

The class names these settings write go through the site's ``label_map``, ``drop`` and ``classes``
as label columns do (:func:`cxrfl.data.label_columns.label_columns`); a name cxrfl does not know is a
new class of this site. Every reader returns the table of :mod:`cxrfl.data.readers`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from cxrfl.data.label_columns import label_columns
from cxrfl.data.label_table import _KEY, _absolute, _finish, _first_line, _read_csv, csv_images, csv_special_columns
from cxrfl.data.site_config import SiteConfig
from cxrfl.data.subgroups import subgroup_frame
from cxrfl.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".dcm", ".dicom")
_BLANK = ("", "nan", "na")


def _classes(names: Sequence[str], config: SiteConfig, source: Path, problems: list[str]) -> dict[str, str]:
    """Class names written in the layout settings -> the site's classes (``label_map``, ``drop``, ``classes``).

    Args:
        names: the class names as the settings write them (new names allowed).
        config: the site config.
        source: the label file or image folder, for messages.
        problems: receives what ``drop`` removed.
    """
    own = {n: n for n in names}  # a name the settings write is a class of the site, even a new one
    config = dataclasses.replace(config, label_map={**own, **config.label_map})
    return label_columns(list(dict.fromkeys(names)), config, source, problems, kind="classes")


def _image_files(root: Path, problems: list[str]) -> list[str]:
    """Image files under ``root`` (relative, ``/``-separated, sorted); hidden entries skipped.

    Symlinked folders are not followed; other files are counted in ``problems``.
    """
    if not root.is_dir():
        raise DataError(f"dataset.images folder {root} does not exist; check the path in the site config")
    found: list[str] = []
    other: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = Path(folder).relative_to(root)
        for name in sorted(f for f in files if not f.startswith(".")):
            (found if name.lower().endswith(IMAGE_SUFFIXES) else other).append((rel / name).as_posix())
    if other:
        problems.append(
            f"{len(other)} file(s) under {root} are not an image ({', '.join(IMAGE_SUFFIXES)}) and were "
            f"ignored, e.g. {other[0]}"
        )
    if not found:
        raise DataError(f"{root} holds no image ({', '.join(IMAGE_SUFFIXES)}); check dataset.images")
    return found


def _folder_of(rel: str, root: Path, config: SiteConfig) -> tuple[str | None, str]:
    """The split (or None) and class folder of one image path, or the one-line error."""
    ds = config.dataset
    parts = rel.split("/")
    depth = 2 if ds.split_folders else 1
    if len(parts) <= depth:
        where = "a split folder and a class folder" if ds.split_folders else "a class folder"
        raise DataError(f"{root / rel}: image is not inside {where} of dataset.images ({root}); move it or remove it")
    split = None
    if ds.split_folders:
        if parts[0] not in ds.split_folders:
            raise DataError(
                f"{root / parts[0]}: folder {parts[0]!r} is not in dataset.split_folders "
                f"({', '.join(ds.split_folders)}); add it or move it out of dataset.images"
            )
        split = ds.split_folders[parts[0]]
    folder = parts[depth - 1]
    if folder not in (ds.class_folders or {}):
        raise DataError(
            f"{root.joinpath(*parts[:depth])}: folder {folder!r} is not a class of dataset.class_folders "
            f"({', '.join(ds.class_folders or {})}); map it to a class (null: no finding) or move it out"
        )
    return split, folder


def _matches(pattern: str, names: pd.Series, setting: str, where: str) -> pd.Series:
    """Which file names a pattern matches; a pattern that matches none is the one-line error."""
    hits = names.map(lambda n: re.search(pattern, n) is not None)
    if not hits.any():
        raise DataError(
            f"{setting} pattern {pattern!r} matches no file name {where} (e.g. {names.iloc[0]!r}); fix the pattern"
        )
    return hits


def _patients(names: pd.Series, rel: pd.Series, root: Path, pattern: str | None) -> pd.Series:
    """The patient of each image from its file name (``(?P<patient>...)``), or its path."""
    if pattern is None:
        return rel
    _matches(pattern, names, "dataset.patient_pattern", f"under {root}")
    patient = names.map(lambda n: (m := re.search(pattern, n)) and m.group("patient"))
    if patient.isna().any() or patient.eq("").any():
        bad = patient.isna() | patient.eq("")
        raise DataError(
            f"{root / rel[bad].iloc[0]}: file name does not match dataset.patient_pattern {pattern!r} "
            f"({int(bad.sum())} of {len(names)} file(s) do not); fix the pattern or move the files"
        )
    return patient


def _folder_labels(folder: pd.Series, names: pd.Series, root: Path, config: SiteConfig) -> pd.DataFrame:
    """One column per class name of ``class_folders`` and ``subclasses`` (1.0, 0.0 or NaN per image)."""
    ds = config.dataset
    folders = ds.class_folders or {}
    out = {c: (folder.map(folders) == c).astype(np.float64) for c in dict.fromkeys(c for c in folders.values() if c)}
    for parent, patterns in ds.subclasses.items():
        inside = folder.eq(parent)
        hits = {
            p: _matches(p, names[inside], f"dataset.subclasses.{parent}", f"in folder {parent!r} under {root}")
            for p in patterns
        }
        any_hit = pd.concat(hits.values(), axis=1).any(axis=1)
        for pattern, name in patterns.items():
            value = pd.Series(0.0, index=folder.index)
            value[inside] = np.where(hits[pattern], 1.0, np.where(any_hit, 0.0, np.nan))
            out[name] = value
    return pd.DataFrame(out, index=folder.index)


def read_folders(config: SiteConfig) -> pd.DataFrame:
    """One folder per class, optional split folders (``dataset.class_folders``, ``split_folders``,
    ``patient_pattern``, ``subclasses``; see the module docstring).

    Args:
        config: the site config (``dataset.format == "folders"``).

    Raises:
        DataError: a folder that is not a class (or split), an image outside one, a class folder
            or pattern that matches no file, a file name the patient pattern does not match.
    """
    ds = config.dataset
    root = ds.images.resolve()
    problems: list[str] = []
    rel = pd.Series(_image_files(root, problems))
    where = [_folder_of(r, root, config) for r in rel]
    folder = pd.Series([f for _, f in where])
    empty = [f for f in (ds.class_folders or {}) if not folder.eq(f).any()]
    if empty:
        raise DataError(
            f"dataset.class_folders: folder {empty[0]!r} holds no image under {root}; fix the name or remove it"
        )
    names = rel.map(lambda r: r.rsplit("/", 1)[-1])
    frame = pd.DataFrame(
        {"path": _absolute(root, rel), "patient": _patients(names, rel, root, ds.patient_pattern), _KEY: rel}
    )
    if ds.split_folders:
        frame["split"] = [s for s, _ in where]
    labels = _folder_labels(folder, names, root, config)
    mapping = _classes(list(labels.columns), config, root, problems)
    frame = frame.join(labels[list(mapping)].rename(columns=mapping))
    return _finish(frame, list(mapping.values()), "path", config, problems)


def _unmapped_line(raw: pd.Series, bad: pd.Series, config: SiteConfig) -> str:
    """The one-line error for finding values that ``values`` does not map."""
    ds = config.dataset
    shown = list(dict.fromkeys(raw[bad].str.strip()))
    more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
    return (
        f"{ds.labels}, line {_first_line(bad)}, column {ds.finding_column!r}: value(s) "
        f"{', '.join(map(repr, shown[:5]))}{more} ({int(bad.sum())} row(s)) are not in dataset.values; map each "
        "to a class (null: no finding) or list it in dataset.unlabelled_values"
    )


def read_categorical(config: SiteConfig) -> pd.DataFrame:
    """A CSV with one categorical finding column (``dataset.finding_column``, ``values``,
    ``unlabelled_values``; see the module docstring). Values are compared without case and
    surrounding blanks.

    Args:
        config: the site config (``dataset.format == "categorical"``).

    Raises:
        DataError: a value neither mapped nor unlabelled (names the file, line and values).
    """
    ds = config.dataset
    assert ds.labels is not None  # required for this format (DatasetConfig)
    column = ds.finding_column
    assert column is not None
    raw = _read_csv(ds.labels, "dataset.labels", [*csv_special_columns(config), column])
    problems: list[str] = []
    key = raw[column].str.strip().str.casefold()
    values = {str(k).strip().casefold(): v for k, v in ds.values.items()}
    unlabelled = key.isin([str(u).strip().casefold() for u in ds.unlabelled_values]) | key.isin(_BLANK)
    bad = ~key.isin(list(values)) & ~unlabelled
    if bad.any():
        raise DataError(_unmapped_line(raw[column], bad, config))
    mapping = _classes([v for v in ds.values.values() if v], config, ds.labels, problems)
    found = key.map(values)
    labels = pd.DataFrame({k: (found == c).astype(np.float64) for c, k in mapping.items()}, index=raw.index)
    labels[unlabelled.to_numpy()] = np.nan
    frame = csv_images(raw, config).join(labels).join(subgroup_frame(raw, config, ds.labels, problems))
    return _finish(frame, list(mapping.values()), ds.path_column, config, problems)


def read_registry(config: SiteConfig) -> pd.DataFrame:
    """A registry of one disease (``dataset.site_label``, ``derived``; see the module docstring).

    Args:
        config: the site config (``dataset.format == "registry"``).
    """
    ds = config.dataset
    assert ds.labels is not None  # required for this format (DatasetConfig)
    raw = _read_csv(ds.labels, "dataset.labels", [*csv_special_columns(config), *ds.derived.values()])
    problems: list[str] = []
    columns = {ds.site_label: pd.Series(1.0, index=raw.index)} if ds.site_label else {}
    for name, column in ds.derived.items():
        columns[name] = (~raw[column].str.strip().str.lower().isin(_BLANK)).astype(np.float64)
    mapping = _classes(list(columns), config, ds.labels, problems)
    labels = pd.DataFrame({k: columns[c] for c, k in mapping.items()}, index=raw.index)
    frame = csv_images(raw, config).join(labels).join(subgroup_frame(raw, config, ds.labels, problems))
    return _finish(frame, list(mapping.values()), ds.path_column, config, problems)


LAYOUT_READERS: dict[str, Callable[[SiteConfig], pd.DataFrame]] = {
    "folders": read_folders,
    "categorical": read_categorical,
    "registry": read_registry,
}
