"""Readers for the published chest X-ray label formats (NIH, CheXpert, MIMIC-CXR-JPG, generic CSV);
the native layouts of smaller public sets (folders, categorical, registry) are in :mod:`cxrfl.data.layouts`,
what builds the table below (paths, splits, the finished table) in :mod:`cxrfl.data.label_table`.

Every reader returns the same table: one row per image with ``path`` (absolute), ``patient``
(string), optionally ``split`` (``train``/``val``/``test``, when the data provides one), then one
float column per canonical class: 1.0 positive, 0.0 negative, NaN unknown, then the subgroup
columns the data has (``sex``, ``age``, ``view``: :mod:`cxrfl.data.subgroups`).

Label values:

* NIH: full labels, a finding is positive when named in ``Finding Labels``, else negative.
* CheXpert / MIMIC-CXR: ``1`` positive, ``0`` negative, ``-1`` uncertain (``dataset.uncertain``:
  ``zeros`` -> 0, ``ones`` -> 1, ``ignore`` -> NaN), blank = not mentioned in the report -> 0
  (as the papers and most CheXpert work treat it).
* Generic CSV: ``1``, ``0``, ``-1`` (uncertain policy as above), blank or ``NaN`` -> unknown (NaN).

``No Finding`` is never a class. Problems that do not stop reading (e.g. MIMIC images whose
study has no label row) are listed in ``table.attrs["problems"]``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from cxrfl.data.label_columns import declared_classes, label_columns
from cxrfl.data.label_table import _KEY, _absolute, _finish, _first_line, _read_csv, csv_images, csv_special_columns
from cxrfl.data.labels import NIH_COLUMN_NAMES, NO_FINDING, UnknownLabelError, canonical_name, normalise_key
from cxrfl.data.layouts import LAYOUT_READERS
from cxrfl.data.site_config import SiteConfig
from cxrfl.data.subgroups import DEFAULT_COLUMNS, subgroup_frame
from cxrfl.errors import ConfigError, DataError

_FRONTAL = ("PA", "AP")
_CHEXPERT_META = ("Path", "Sex", "Age", "Frontal/Lateral", "AP/PA")
_MIMIC_META = ("subject_id", "study_id")


def _parse_values(column: pd.Series, *, path: Path, name: str, blank: float, uncertain: str) -> np.ndarray:
    """Turn one label column (strings) into floats, naming the line of the first bad value.

    Args:
        column: the raw values, index = read_csv row number.
        path: the file, for messages.
        name: the column name, for messages.
        blank: the value of a blank cell (0.0 or NaN).
        uncertain: policy for ``-1``: ``zeros``, ``ones`` or ``ignore``.
    """
    text = column.str.strip()
    is_blank = text.eq("") | text.str.lower().isin(("nan", "na"))
    values = pd.to_numeric(text.mask(is_blank), errors="coerce")
    bad = ~is_blank & ~values.isin((1, 0, -1))
    if bad.any():
        raw = column[bad].iloc[0]
        raise DataError(
            f"{path}, line {_first_line(bad)}, column {name!r}: label value {raw!r} is not 1, 0, -1 or blank; "
            "fix the file"
        )
    out = values.to_numpy(dtype=np.float64, copy=True)
    out[is_blank.to_numpy()] = blank
    out[out == -1] = {"zeros": 0.0, "ones": 1.0, "ignore": np.nan}[uncertain]
    return out


def _views(config: SiteConfig) -> tuple[str, ...] | None:
    return tuple(v.upper() for v in config.dataset.views) if config.dataset.views else None


def _variants_line(tokens: pd.Series, rename: dict[str, str], path: Path) -> str:
    """The warning for NIH findings spelled differently: how many rows, which lines, read as what."""
    parts = []
    for name, spelling in rename.items():
        lines = sorted({int(i) + 2 for i in tokens.index[tokens.eq(name)]})
        more = f" and {len(lines) - 5} more" if len(lines) > 5 else ""
        parts.append(f"{name!r} as {spelling!r} ({len(lines)} row(s), line(s) {', '.join(map(str, lines[:5]))}{more})")
    rows = tokens.index[tokens.isin(list(rename))].unique()
    return f"{path}: {len(rows)} row(s) spell a finding of 'Finding Labels' differently; read {'; '.join(parts)}"


def _nih_findings(tokens: pd.Series, config: SiteConfig, path: Path, problems: list[str]) -> pd.Series:
    """``Finding Labels`` tokens in NIH spelling.

    Case, ``_``/space and synonym variants of a finding (``effusion``, ``Pleural Effusion`` for
    ``Effusion``) are read as that finding, with one line in ``problems`` that counts them.

    Args:
        tokens: one finding per entry, index = read_csv row.
        config: the site config (its label_map keys and classes are known names too).
        path: the label file, for messages.
        problems: list that receives the warning.

    Raises:
        DataError: a finding cxrfl does not know and the config neither maps, declares nor drops.
    """
    dropped = {normalise_key(d) for d in config.drop}
    nih_spelling = {canon: name for name, canon in NIH_COLUMN_NAMES.items()}
    known = [*declared_classes(config), *config.label_map]
    rename = {}
    for name in dict.fromkeys(tokens):
        if name in NIH_COLUMN_NAMES or name == NO_FINDING:
            continue
        try:
            finding = canonical_name(name, extra=known)
        except UnknownLabelError as exc:
            if normalise_key(name) in dropped:
                continue
            line = _first_line(tokens.eq(name).groupby(level=0).any())
            raise DataError(f"{path}, line {line}, column 'Finding Labels': {exc}") from exc
        if nih_spelling.get(finding, finding) != name:
            rename[name] = nih_spelling.get(finding, finding)
    if rename:
        problems.append(_variants_line(tokens, rename, path))
        tokens = tokens.replace(rename)
    return tokens


def read_nih(config: SiteConfig) -> pd.DataFrame:
    """NIH ChestX-ray14 ``Data_Entry_2017*.csv`` (optionally ``.gz``).

    Findings are joined with ``|`` in ``Finding Labels`` (variants of a finding's spelling are
    read as it, with a warning: :func:`_nih_findings`); images are ``images/<Image Index>``;
    ``views`` (if set) filters ``View Position``. The file's unquoted
    ``OriginalImage[Width,Height]`` headers are tolerated (only the needed columns are read).

    Args:
        config: the site config (``dataset.format == "nih"``).
    """
    ds = config.dataset
    assert ds.labels is not None  # required for this format (DatasetConfig)
    key = "Image Index"
    need = (key, "Finding Labels", "Patient ID", "View Position")
    wanted = {*need, *DEFAULT_COLUMNS["nih"].values()}
    raw = _read_csv(ds.labels, "dataset.labels", need, usecols=lambda c: c.strip() in wanted)
    raw = raw.apply(lambda s: s.str.strip())
    views = _views(config)
    if views:
        raw = raw[raw["View Position"].str.upper().isin(views)]
        if raw.empty:
            raise DataError(f"{ds.labels} has no image with View Position in {', '.join(views)}")
    tokens = raw["Finding Labels"].str.split("|").explode().str.strip()
    if tokens.eq("").any():
        raise DataError(f"{ds.labels}, line {_first_line(tokens.eq(''))}: empty 'Finding Labels' (use 'No Finding')")
    problems: list[str] = []
    tokens = _nih_findings(tokens, config, ds.labels, problems)

    def locate(name: str) -> str:
        rows = tokens.eq(name).groupby(level=0).any()
        return f", line {_first_line(rows)}, column 'Finding Labels'" if rows.any() else ", column 'Finding Labels'"

    extra = [t for t in dict.fromkeys(tokens) if t not in NIH_COLUMN_NAMES and t != NO_FINDING]
    mapping = label_columns([*NIH_COLUMN_NAMES, *extra], config, ds.labels, problems, kind="findings", locate=locate)
    codes = pd.Index(list(mapping)).get_indexer(tokens)
    rows = raw.index.get_indexer(tokens.index)
    matrix = np.zeros((len(raw), len(mapping)))
    matrix[rows[codes >= 0], codes[codes >= 0]] = 1.0
    frame = pd.DataFrame(
        {"path": _absolute(ds.images, raw[key]), "patient": raw["Patient ID"], _KEY: raw[key]}, index=raw.index
    )
    frame = frame.join(pd.DataFrame(matrix, index=raw.index, columns=list(mapping.values())))
    frame = frame.join(subgroup_frame(raw, config, ds.labels, problems))
    return _finish(frame, list(mapping.values()), key, config, problems)


def _chexpert_root(images: Path, first: str) -> Callable[[str], str]:
    """How to turn a CheXpert ``Path`` into a path under ``images``.

    ``Path`` starts with the archive folder (``CheXpert-v1.0-small/train/...``); ``images`` may be
    that folder or its parent.

    Args:
        images: the configured image root.
        first: the ``Path`` of the first row.
    """
    top, _, rest = first.partition("/")
    if (images / top).is_dir() or not rest:
        return lambda p: p
    if images.name == top or (images / rest).exists():
        return lambda p: p.partition("/")[2]
    return lambda p: p


def _label_frame(raw: pd.DataFrame, mapping: dict[str, str], config: SiteConfig, blank: float) -> pd.DataFrame:
    """Parse the label columns ``mapping`` of ``raw`` into a float frame named by class."""
    ds = config.dataset
    assert ds.labels is not None  # required for this format (DatasetConfig)
    columns = {
        k: _parse_values(raw[c], path=ds.labels, name=c, blank=blank, uncertain=ds.uncertain)
        for c, k in mapping.items()
    }
    return pd.DataFrame(columns, index=raw.index)


def read_chexpert(config: SiteConfig) -> pd.DataFrame:
    """CheXpert ``train.csv`` / ``valid.csv``: frontal images, patient parsed from ``Path``.

    ``views`` (if set) keeps frontal images whose ``AP/PA`` is in it; ``-1`` follows
    ``dataset.uncertain``; blank = not mentioned = 0.

    Args:
        config: the site config (``dataset.format == "chexpert"``).
    """
    ds = config.dataset
    assert ds.labels is not None  # required for this format (DatasetConfig)
    key = "Path"
    raw = _read_csv(ds.labels, "dataset.labels", (key, "Frontal/Lateral"))
    problems: list[str] = []
    mapping = label_columns([c for c in raw.columns if c not in _CHEXPERT_META], config, ds.labels, problems)
    raw = raw[raw["Frontal/Lateral"].str.strip().str.lower().eq("frontal")]
    views = _views(config)
    if views:
        if "AP/PA" not in raw:
            raise DataError(f"{ds.labels} has no 'AP/PA' column to filter views {', '.join(views)}")
        raw = raw[raw["AP/PA"].str.strip().str.upper().isin(views)]
    if raw.empty:
        raise DataError(f"{ds.labels} has no frontal image{' with AP/PA in ' + ', '.join(views) if views else ''}")
    rel = raw[key].str.strip().str.replace("\\", "/", regex=False)
    patient = rel.str.extract(r"(patient\d+)", flags=re.IGNORECASE, expand=False)
    if patient.isna().any():
        raise DataError(
            f"{ds.labels}, line {_first_line(patient.isna())}, column 'Path': no 'patientNNNNN' folder in "
            f"{rel[patient.isna()].iloc[0]!r}"
        )
    image = _absolute(ds.images, rel.map(_chexpert_root(ds.images, rel.iloc[0])))
    frame = pd.DataFrame({"path": image, "patient": patient, _KEY: rel}, index=raw.index)
    frame = frame.join(_label_frame(raw, mapping, config, blank=0.0))
    frame = frame.join(subgroup_frame(raw, config, ds.labels, problems))
    return _finish(frame, list(mapping.values()), key, config, problems)


def read_mimic(config: SiteConfig) -> pd.DataFrame:
    """MIMIC-CXR-JPG: study labels (``*-chexpert.csv``) joined to the frontal images of ``metadata``.

    Images are ``images/files/p<first 2 digits>/p<subject>/s<study>/<dicom_id>.jpg`` (``images``
    may also be the ``files`` folder itself); patient = ``subject_id``; ``split_file`` (the
    official ``*-split.csv``) gives train/validate/test per ``dicom_id``. ``-1`` follows
    ``dataset.uncertain``; blank = not mentioned = 0.

    Args:
        config: the site config (``dataset.format == "mimic"``, ``dataset.metadata`` set).
    """
    ds = config.dataset
    assert ds.labels is not None  # required for this format (DatasetConfig)
    if ds.metadata is None:
        where = f" in {config.source}" if config.source else ""
        raise ConfigError(f"dataset.metadata (mimic-cxr-2.0.0-metadata.csv) is required for format mimic{where}")
    raw = _read_csv(ds.labels, "dataset.labels", _MIMIC_META)
    problems: list[str] = []
    mapping = label_columns([c for c in raw.columns if c not in _MIMIC_META], config, ds.labels, problems)
    studies = raw[list(_MIMIC_META)].apply(lambda s: s.str.strip())
    twice = studies.duplicated(keep=False)
    if twice.any():
        study = studies["study_id"][twice].iloc[0]
        raise DataError(f"{ds.labels}, line {_first_line(twice)}: study {study} has two label rows; remove one")
    studies = studies.join(_label_frame(raw, mapping, config, blank=0.0))
    meta_cols = ("dicom_id", "subject_id", "study_id", "ViewPosition")
    meta = _read_csv(ds.metadata, "dataset.metadata", meta_cols, usecols=meta_cols).apply(lambda s: s.str.strip())
    views = _views(config) or _FRONTAL
    meta = meta[meta["ViewPosition"].str.upper().isin(views)]
    if meta.empty:
        raise DataError(f"{ds.metadata} has no image with ViewPosition in {', '.join(views)}")
    frame = meta.join(studies.set_index(list(_MIMIC_META)), on=list(_MIMIC_META), how="inner")  # rows of metadata
    if len(frame) < len(meta):
        problems.append(
            f"{len(meta) - len(frame)} image(s) of {ds.metadata} belong to studies without a row in "
            f"{ds.labels} and were left out"
        )
    if frame.empty:
        raise DataError(f"no study of {ds.labels} matches an image of {ds.metadata} (subject_id, study_id)")
    files = "" if ds.images.name == "files" and not (ds.images / "files").is_dir() else "files/"
    subject = frame["subject_id"]
    rel = files + "p" + subject.str[:2] + "/p" + subject + "/s" + frame["study_id"] + "/" + frame["dicom_id"] + ".jpg"
    frame = frame.assign(path=_absolute(ds.images, rel), patient=subject, **{_KEY: frame["dicom_id"]})
    frame = frame.join(subgroup_frame(frame, config, ds.metadata, problems))
    return _finish(frame, list(mapping.values()), "dicom_id", config, problems)


def read_csv(config: SiteConfig) -> pd.DataFrame:
    """A generic CSV: an image path column, optional patient and split columns, label columns.

    Every other column but ``dataset.subgroups`` is a label column (``1``/``0``/``-1``/blank =
    unknown); image paths and patients as :func:`cxrfl.data.label_table.csv_images` reads them.

    Args:
        config: the site config (``dataset.format == "csv"``).
    """
    ds = config.dataset
    assert ds.labels is not None  # required for this format (DatasetConfig)
    special = csv_special_columns(config)
    raw = _read_csv(ds.labels, "dataset.labels", special)
    problems: list[str] = []
    other = [c for c in raw.columns if c not in special and c not in ds.subgroups.values()]
    mapping = label_columns(other, config, ds.labels, problems)
    frame = csv_images(raw, config).join(_label_frame(raw, mapping, config, blank=np.nan))
    frame = frame.join(subgroup_frame(raw, config, ds.labels, problems))
    return _finish(frame, list(mapping.values()), ds.path_column, config, problems)


READERS: dict[str, Callable[[SiteConfig], pd.DataFrame]] = {
    "nih": read_nih,
    "chexpert": read_chexpert,
    "mimic": read_mimic,
    "csv": read_csv,
}


def read_labels(config: SiteConfig) -> pd.DataFrame:
    """Read a site's label file with the reader of its format.

    Args:
        config: the site config.

    Returns:
        columns ``path``, ``patient``, optional ``split``, then one float column per class.

    Raises:
        DataError: the file is missing, unreadable or malformed (message names file and line).
        ConfigError: the config asks for classes the file does not provide.
    """
    readers = {**READERS, **LAYOUT_READERS}
    reader = readers.get(config.dataset.format)
    if reader is None:
        raise ConfigError(f"dataset.format {config.dataset.format!r} is not supported; use one of {', '.join(readers)}")
    return reader(config)
