"""Subgroup fields of a site's images (sex, age, view) for the subgroup audit, read beside the labels.

Each reader passes its label file's rows to :func:`subgroup_frame`; the columns it gets are
``dataset.subgroups`` (``csv``, ``categorical``, ``registry``) or the format's own
(:data:`DEFAULT_COLUMNS`, those the file has). Values are normalised here only:

* ``sex``: ``"F"`` / ``"M"`` (f, female, w; m, male; any case), else unknown (NaN);
* ``age``: float years (``57``, ``57.0``, NIH's ``058Y``; ``006M``, ``010D``, ``008W`` are
  months, days, weeks), unknown outside [0, 120];
* ``view``: stripped upper case (``pa`` -> ``PA``, ``LATERAL`` -> ``LL``); CheXpert's lateral images
  (``Frontal/Lateral`` = ``Lateral``, blank ``AP/PA``) are ``LL``.

A value that becomes unknown (blanks aside) never stops the site: each field's count is one line
in ``problems`` naming the file, the column and an example.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from cxrfl.errors import DataError

if TYPE_CHECKING:
    from cxrfl.data.site_config import SiteConfig

SUBGROUP_FIELDS = ("sex", "age", "view")
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {  # format -> field -> column, read where the file has it
    "nih": {"sex": "Patient Gender", "age": "Patient Age", "view": "View Position"},
    "chexpert": {"sex": "Sex", "age": "Age", "view": "AP/PA"},
    "mimic": {"view": "ViewPosition"},
}
_BLANK = ("", "nan", "na")
_SEX = {"f": "F", "female": "F", "w": "F", "m": "M", "male": "M"}
_PER_YEAR = {"": 1.0, "y": 1.0, "m": 12.0, "w": 52.1775, "d": 365.25}  # unit suffix -> units per year
_VIEW = {"LATERAL": "LL"}
_MAX_AGE = 120.0
_READS = {
    "sex": "F or M (f, female, w, m, male)",
    "age": f"years from 0 to {_MAX_AGE:g} (57, 57.0, 058Y; 006M months, 010D days)",
}


def subgroup_columns(config: SiteConfig, header: pd.Index, path: Path) -> dict[str, str]:
    """The columns a label file's subgroup fields come from: field -> column, in field order.

    Args:
        config: the site config (``dataset.subgroups``, else the format's :data:`DEFAULT_COLUMNS`).
        header: the file's columns.
        path: the file, for messages.

    Raises:
        DataError: a column ``dataset.subgroups`` names is not in the file.
    """
    configured = config.dataset.subgroups
    for name, column in configured.items():
        if column not in header:
            where = f" (site config {config.source})" if config.source else ""
            raise DataError(
                f"{path} has no column {column!r} named by dataset.subgroups.{name}{where}; its columns are "
                f"{', '.join(map(repr, header))}: fix the setting or remove the key"
            )
    wanted = configured or DEFAULT_COLUMNS.get(config.dataset.format, {})
    return {f: wanted[f] for f in SUBGROUP_FIELDS if f in wanted and wanted[f] in header}


def subgroup_frame(raw: pd.DataFrame, config: SiteConfig, path: Path, problems: list[str]) -> pd.DataFrame:
    """The normalised subgroup columns of a label file's rows (none where the file has none).

    Args:
        raw: the file's rows as strings, index = file row (CheXpert: with ``Frontal/Lateral``).
        config: the site config.
        path: the file, for messages.
        problems: receives one line per field with values that became unknown.
    """
    columns = subgroup_columns(config, raw.columns, path)
    out = {}
    for name, column in columns.items():
        text = raw[column].str.strip()
        if name == "view" and config.dataset.format == "chexpert":  # a lateral image's AP/PA is blank
            text = text.mask(raw["Frontal/Lateral"].str.strip().str.lower().eq("lateral"), "LATERAL")
        blank = text.str.lower().isin(_BLANK)
        values = _NORMALISE[name](text.mask(blank))
        bad = values.isna() & ~blank
        if bad.any():
            problems.append(
                f"{path}, column {column!r}: {int(bad.sum())} {name} value(s) are not {_READS[name]} and count "
                f"as unknown, e.g. {text[bad].iloc[0]!r}; fix them in the file or leave them blank"
            )
        out[name] = values
    return pd.DataFrame(out, index=raw.index)


def _sex(text: pd.Series) -> pd.Series:
    return text.str.lower().map(_SEX)


def _age(text: pd.Series) -> pd.Series:
    parts = text.str.lower().str.extract(r"^(\d+(?:\.\d*)?)\s*([ymwd]?)$")
    years = pd.to_numeric(parts[0]) / parts[1].map(_PER_YEAR)
    return years.where(years.between(0.0, _MAX_AGE)).astype(float)


def _view(text: pd.Series) -> pd.Series:
    return text.str.upper().replace(_VIEW)


_NORMALISE = {"sex": _sex, "age": _age, "view": _view}


def describe_subgroups(table: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Counts of each subgroup field a site table has (plain JSON values).

    Args:
        table: a site table (:class:`cxrfl.data.site.SiteData`).

    Returns:
        field -> ``sex``/``view``: value -> images, most frequent first; ``age``: ``median``,
        ``min``, ``max`` (years, None without any age); each with ``unknown`` (images without a value).
    """
    out: dict[str, dict[str, Any]] = {}
    for name in (f for f in SUBGROUP_FIELDS if f in table):
        values = table[name]
        if name == "age":
            known = values.dropna()
            stats = (known.median(), known.min(), known.max()) if len(known) else (None, None, None)
            out[name] = dict(zip(("median", "min", "max"), (None if s is None else float(s) for s in stats)))
        else:
            out[name] = {str(k): int(n) for k, n in values.value_counts().items()}
        out[name]["unknown"] = int(values.isna().sum())
    return out


def subgroups_line(described: dict[str, dict[str, Any]]) -> str | None:
    """``subgroups: sex F 512, M 488; age median 47 (1-94), unknown 3; view PA 700, AP 300``, or None.

    Args:
        described: :func:`describe_subgroups` of a site table.
    """
    parts = []
    for name, counts in described.items():
        if name == "age":
            known = counts["median"] is not None
            shown = [f"median {counts['median']:g} ({counts['min']:g}-{counts['max']:g})"] if known else []
        else:
            shown = [f"{value} {n}" for value, n in counts.items() if value != "unknown"]
        if counts["unknown"]:
            shown.append(f"unknown {counts['unknown']}")
        parts.append(f"{name} {', '.join(shown)}")
    return f"subgroups: {'; '.join(parts)}" if parts else None
