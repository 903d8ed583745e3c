"""Readers for the published chest X-ray label formats (NIH, CheXpert, MIMIC-CXR-JPG, generic CSV);
the native layouts of smaller public sets (folders, categorical, registry) are in :mod:`cxrfl.data.layouts`.

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

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from cxrfl.data.label_columns import declared_classes, label_columns
from cxrfl.data.labels import NIH_COLUMN_NAMES, NO_FINDING, UnknownLabelError, canonical_name, normalise_key
from cxrfl.data.site_config import SiteConfig
from cxrfl.data.subgroups import DEFAULT_COLUMNS, SUBGROUP_FIELDS, subgroup_frame
from cxrfl.errors import ConfigError, DataError

_SPLIT_NAMES = {
    "train": "train",
    "training": "train",
    "val": "val",
    "valid": "val",
    "validate": "val",
    "validation": "val",
    "test": "test",
}
_FRONTAL = ("PA", "AP")
_CHEXPERT_META = ("Path", "Sex", "Age", "Frontal/Lateral", "AP/PA")
_MIMIC_META = ("subject_id", "study_id")
_KEY = "_key"  # internal column: the value a split_file row is matched on


def _first_line(mask: pd.Series) -> int:
    """The file line (header = line 1) of the first True row of a mask over a read_csv index."""
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


def _split_values(column: pd.Series, path: Path, name: str) -> pd.Series:
    """Normalise split names (``validate`` -> ``val`` ...), naming the line of a bad one."""
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
    unknown); image paths and patients as :func:`csv_images` reads them.

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


def csv_special_columns(config: SiteConfig) -> list[str]:
    """The path, patient and split columns a CSV layout names (``csv``, ``categorical``, ``registry``)."""
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
    from cxrfl.data.layouts import LAYOUT_READERS  # the native layouts build on this module's helpers

    readers = {**READERS, **LAYOUT_READERS}
    reader = readers.get(config.dataset.format)
    if reader is None:
        raise ConfigError(f"dataset.format {config.dataset.format!r} is not supported; use one of {', '.join(readers)}")
    return reader(config)
