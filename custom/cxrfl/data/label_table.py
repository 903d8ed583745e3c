"""The table every label reader returns (:mod:`cxrfl.data.readers`, :mod:`cxrfl.data.layouts`), and what builds it:
reading a label CSV, the image paths under ``dataset.images`` (refusing those outside it), the ``split`` column or
``dataset.split_file``, and the finished table with its ``attrs["problems"]``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from cxrfl.data.site_config import SiteConfig
from cxrfl.data.subgroups import SUBGROUP_FIELDS
from cxrfl.errors import DataError

_SPLIT_NAMES = {
    "train": "train",
    "training": "train",
    "val": "val",
    "valid": "val",
    "validate": "val",
    "validation": "val",
    "test": "test",
}
_KEY = "_key"  # internal column: the value a split_file row is matched on


def _first_line(mask: pd.Series) -> int:
    """The file line (header = line 1) of the first True row of a mask over a read_csv index.

    Args:
        mask: True at the rows looked for, index = read_csv row.
    """
    return int(mask[mask].index[0]) + 2


def _read_csv(
    path: Path, what: str, required: Sequence[str], usecols: Sequence[str] | Callable[[str], bool] | None = None
) -> pd.DataFrame:
    """Read a CSV (optionally gzip-compressed) as strings, blanks kept as ``""``.

    Args:
        path: the file.
        what: what the file is, for messages (``dataset.labels`` ...).
        required: columns that must be present.
        usecols: read only these columns, or those a callable keeps (tolerates rows with more fields
            than header names).
    """
    if not path.is_file():
        raise DataError(f"{what} file {path} does not exist; check the path in the site config")
    try:
        header = [str(c).strip() for c in pd.read_csv(path, nrows=0, index_col=False).columns]
        missing = [c for c in required if c not in header]
        if missing:
            raise DataError(
                f"{path} has no column(s) {', '.join(repr(c) for c in missing)} needed for {what}; "
                f"its columns are {', '.join(repr(c) for c in header)}"
            )
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, index_col=False, usecols=usecols)
    except DataError:
        raise
    except pd.errors.EmptyDataError as exc:
        raise DataError(f"{what} file {path} is empty") from exc
    except (pd.errors.ParserError, UnicodeDecodeError, OSError, EOFError, ValueError) as exc:
        raise DataError(f"{what} file {path} cannot be read as CSV: {exc}") from exc
    frame.columns = [str(c).strip() for c in frame.columns]
    if frame.empty:
        raise DataError(f"{what} file {path} has a header but no rows")
    return frame


def _split_values(column: pd.Series, path: Path, name: str) -> pd.Series:
    """Normalise split names (``validate`` -> ``val`` ...), naming the line of a bad one.

    Args:
        column: the raw split names, index = read_csv row.
        path: the file, for messages.
        name: the column name, for messages.
    """
    values = column.str.strip().str.lower().map(_SPLIT_NAMES)
    if values.isna().any():
        bad = values.isna()
        raise DataError(
            f"{path}, line {_first_line(bad)}, column {name!r}: split {column[bad].iloc[0]!r} is not one of "
            "train, val (valid, validate), test"
        )
    return values


def _apply_split_file(frame: pd.DataFrame, key: str, config: SiteConfig, problems: list[str]) -> pd.DataFrame:
    """Attach ``split`` from ``dataset.split_file``, matched on column ``key`` of both files.

    Args:
        frame: the reader's table, with the matching values in column ``_key``.
        key: the matching column of the split file (``dicom_id`` for MIMIC, the image column otherwise).
        config: the site config.
        problems: list that receives a line when images are not in the split file.
    """
    path = config.dataset.split_file
    assert path is not None
    splits = _read_csv(path, "dataset.split_file", (key, "split"), usecols=(key, "split"))
    keys = splits[key].str.strip().str.replace("\\", "/", regex=False)  # image paths as the label file's
    splits = pd.DataFrame({_KEY: keys, "split": _split_values(splits["split"], path, "split")})
    twice = splits[_KEY].duplicated(keep=False)
    if twice.any():
        raise DataError(f"{path}, line {_first_line(twice)}: {key} {splits[_KEY][twice].iloc[0]!r} is listed twice")
    out = frame.drop(columns=["split"], errors="ignore").merge(splits, on=_KEY, how="inner")
    if len(out) < len(frame):
        problems.append(f"{len(frame) - len(out)} image(s) are not in split file {path} and were left out")
    if out.empty:
        raise DataError(f"no image of {config.dataset.labels} is listed in split file {path} (matched on {key!r})")
    return out


def _absolute(root: Path, relative: pd.Series) -> pd.Series:
    """Image paths made absolute and normalised (an absolute path stays as it is).

    Args:
        root: the image root (``dataset.images``).
        relative: the paths as written, ``/``-separated.
    """
    base = str(root.resolve())
    return relative.map(lambda p: os.path.normpath(os.path.join(base, p)))


def _confine(frame: pd.DataFrame, config: SiteConfig, problems: list[str]) -> pd.DataFrame:
    """Refuse the rows whose image leaves ``dataset.images`` (absolute paths, ``..``, symlinks followed).

    One line per refused row in ``problems`` (the file and line it was listed on); the others go on.
    ``dataset.allow_outside_images`` turns the check off.

    Args:
        frame: ``path`` (absolute, normalised) and ``_key`` (the value as written), indexed by the
            row of the file the paths come from (MIMIC: ``dataset.metadata``, else ``dataset.labels``;
            ``folders``: the path relative to ``dataset.images``, no line).
        config: the site config.
        problems: receives one line per refused row.

    Raises:
        DataError: every image is outside ``dataset.images``.
    """
    ds = config.dataset
    if ds.allow_outside_images:
        return frame
    root = os.path.realpath(ds.images)
    prefix = root.rstrip(os.sep) + os.sep
    real = frame["path"].map(os.path.realpath)
    inside = real.map(lambda p: p == root or p.startswith(prefix))
    if inside.all():
        return frame
    listed_in = ds.metadata if ds.format == "mimic" else ds.label_source
    lines = [
        f"{listed_in}{'' if ds.labels is None else f', line {row + 2}'}: image {written!r} ({path}) is outside "
        f"dataset.images ({root}); skipped (set dataset.allow_outside_images: true to read images outside it)"
        for row, written, path in zip(frame.index[~inside], frame[_KEY][~inside], real[~inside])
    ]
    if not inside.any():
        raise DataError(f"{lines[0]}; every image of {listed_in} is outside dataset.images ({len(lines)} in all)")
    problems += lines
    return frame[inside]


def _finish(frame: pd.DataFrame, classes: list[str], key: str, config: SiteConfig, problems: list[str]) -> pd.DataFrame:
    """Refuse images outside ``dataset.images``, apply ``split_file``, order the columns, check that
    no image is listed twice.

    Args:
        frame: ``path``, ``patient``, optional ``split``, ``_key`` and the classes, indexed by file row.
        classes: the class columns, in order.
        key: the column of ``split_file`` matched against ``_key``.
        config: the site config.
        problems: non-fatal problems found so far (stored in ``attrs["problems"]``).
    """
    frame = _confine(frame, config, problems)
    if config.dataset.split_file is not None:
        frame = _apply_split_file(frame, key, config, problems)
    subgroups = [f for f in SUBGROUP_FIELDS if f in frame]
    cols = ["path", "patient"] + (["split"] if "split" in frame else []) + classes + subgroups
    out = frame[cols].reset_index(drop=True)
    out[classes] = out[classes].astype(np.float64)
    twice = out["path"].duplicated()
    if twice.any():
        raise DataError(
            f"{config.dataset.label_source}: image {out['path'][twice].iloc[0]} is listed more than once; "
            "remove the duplicate row"
        )
    out.attrs["problems"] = problems
    return out


def csv_special_columns(config: SiteConfig) -> list[str]:
    """The path, patient and split columns a CSV layout names (``csv``, ``categorical``, ``registry``).

    Args:
        config: the site config.
    """
    ds = config.dataset
    return [c for c in (ds.path_column, ds.patient_column, ds.split_column) if c]


def csv_images(raw: pd.DataFrame, config: SiteConfig) -> pd.DataFrame:
    """``path``, ``patient``, ``_key`` and optional ``split`` of a CSV layout's rows.

    Paths are ``path_column`` + ``image_suffix``, relative to ``dataset.images`` (or absolute), with
    ``/`` or Windows ``\\`` separators; without ``patient_column`` every row is its own patient.

    Args:
        raw: the file as strings (:func:`_read_csv`), index = read_csv row.
        config: the site config.

    Raises:
        DataError: an empty path, patient or split cell (names the line).
    """
    ds = config.dataset
    assert ds.labels is not None  # required for this format (DatasetConfig)
    for col in csv_special_columns(config):
        empty = raw[col].str.strip().eq("")
        if empty.any():
            raise DataError(f"{ds.labels}, line {_first_line(empty)}, column {col!r}: empty value")
    rel = raw[ds.path_column].str.strip().str.replace("\\", "/", regex=False) + ds.image_suffix
    frame = pd.DataFrame(
        {
            "path": _absolute(ds.images, rel),
            "patient": raw[ds.patient_column].str.strip() if ds.patient_column else rel,
            _KEY: rel,
        },
        index=raw.index,
    )
    if ds.split_column:
        frame["split"] = _split_values(raw[ds.split_column], ds.labels, ds.split_column)
    return frame
