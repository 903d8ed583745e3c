"""Which label columns of a file become a site's classes: ``drop``, ``label_map``, ``classes``.

Shared by every reader (:mod:`cxrfl.data.readers`); NIH passes its findings as the columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from cxrfl.data.labels import (
    NO_FINDING,
    LabelConflictError,
    UnknownLabelError,
    canonical_name,
    harmonise,
    normalise_key,
)
from cxrfl.data.site_config import SiteConfig
from cxrfl.errors import ConfigError, DataError


def _class_of(name: str, config: SiteConfig) -> str | None:
    """The class a label name means under the site's label_map (None: unknown)."""
    try:
        return harmonise([name], config.label_map, extra=declared_classes(config))[name]
    except UnknownLabelError:
        return None


def _apply_drop(columns: Sequence[str], config: SiteConfig, path: Path, problems: list[str]) -> list[str]:
    """The label columns left after ``drop``.

    An entry written exactly as a column drops that column only (of two columns meaning one
    class, the other stays). Any other entry drops every column whose name or class it names
    (case, ``_`` and ``-`` ignored), and says so in ``problems``, as does an entry that matches
    nothing.

    Args:
        columns: the file's label column names.
        config: the site config.
        path: the file, for messages.
        problems: list that receives the lines.
    """
    kept = list(columns)
    for entry in config.drop:
        name = entry.strip()
        if name in kept:
            kept.remove(name)
            continue
        key = normalise_key(name)
        hits = [c for c in kept if key in (normalise_key(c), normalise_key(_class_of(c, config) or ""))]
        kept = [c for c in kept if c not in hits]
        if hits:
            classes = sorted({_class_of(c, config) or c for c in hits})
            problems.append(
                f"drop {entry!r} removed label(s) {', '.join(map(repr, hits))} of {path} "
                f"(class {', '.join(map(repr, classes))})"
            )
        else:
            problems.append(f"drop {entry!r} matches no label of {path}")
    return kept


def label_columns(
    columns: Sequence[str],
    config: SiteConfig,
    path: Path,
    problems: list[str],
    kind: str = "label columns",
    locate: Callable[[str], str] = lambda name: ", line 1 (the header)",
) -> dict[str, str]:
    """Map a file's label columns to the site's classes (drop, label_map, ``classes`` subset).

    Args:
        columns: the file's label column names, in file order.
        config: the site config.
        path: the file, for messages.
        problems: list that receives non-fatal lines (what ``drop`` removed).
        kind: what the columns are, for messages.
        locate: a label name -> where the file has it (``, line N``), for messages.

    Returns:
        file column -> canonical class, in ``config.classes`` order if given, else file order.
    """
    kept = _apply_drop(columns, config, path, problems)
    try:
        mapping = harmonise(kept, config.label_map, extra=declared_classes(config), kind=kind)
    except LabelConflictError as exc:
        raise DataError(f"{path}{locate(exc.second)}: {exc}") from exc
    except UnknownLabelError as exc:
        raise DataError(f"{path}: label column problem: {exc}") from exc
    mapping = {c: k for c, k in mapping.items() if k != NO_FINDING}
    wanted = declared_classes(config)
    if not wanted:
        if not mapping:
            raise DataError(f"{path} has no label columns left after 'drop'; the site needs at least one class")
        return mapping
    by_class = {k: c for c, k in mapping.items()}
    missing = [k for k in wanted if k not in by_class]
    if missing:
        raise ConfigError(
            f"classes {', '.join(repr(k) for k in missing)} of the site config are not in {path}; "
            f"it provides {', '.join(repr(k) for k in mapping.values())}"
        )
    return {by_class[k]: k for k in wanted}


def declared_classes(config: SiteConfig) -> list[str]:
    """The config's ``classes`` in canonical spelling (a name cxrfl does not know is kept as written).

    Args:
        config: the site config.
    """
    out = []
    for name in config.classes or ():
        try:
            out.append(canonical_name(name))
        except UnknownLabelError:
            out.append(str(name).strip())
    return out
