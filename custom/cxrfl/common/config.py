"""One base for every settings dataclass: from_dict, to_dict, unknown keys, value types, ranges.

A settings class is a frozen dataclass that derives from :class:`Config`, names its section
(``SECTION = "train"``) and declares constraints in field metadata::

    @dataclass(frozen=True)
    class TrainConfig(Config):
        SECTION: ClassVar[str] = "train"
        lr: float = field(default=5e-5, metadata={"gt": 0})
        precision: str = field(default="auto", metadata={"choices": ("auto", "fp32", "bf16", "fp16")})

Every value is checked against its annotation (``int``, ``float``, ``bool``, ``str``, ``None``
unions, ``tuple[str, ...]``, ``list[...]``, ``dict[str, str]``, ``Path``, a nested ``Config``) and
against ``choices``, ``ge``, ``gt``, ``le``, ``lt``; a wrong value is one
:class:`cxrfl.errors.ConfigError` line naming ``section.key``, what is allowed and what was given
(and the file, when known). Lists become tuples for tuple fields, texts paths for ``Path`` fields;
``from_dict`` builds nested ``Config`` sections from mappings and names a missing required key.
Cross-field rules stay in the subclass's ``__post_init__`` (call ``super().__post_init__()`` first).

A renamed or replaced key stays readable for one release through ``LEGACY`` (old key ->
:class:`LegacyKey`): ``from_dict`` checks the old value's type, turns it into the new settings
(an explicitly given new key wins) and logs one deprecation line per key and process.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from cxrfl.errors import ConfigError

C = TypeVar("C", bound="Config")
log = logging.getLogger(__name__)
_WARNED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class LegacyKey:
    """An old settings key still accepted for one release.

    Args:
        type: the annotation the old value must match.
        translate: old value -> the new settings it stands for.
        advice: what to write instead (ends the deprecation line).
    """

    type: Any
    translate: Callable[[Any], Mapping[str, Any]]
    advice: str


def _describe(tp: Any) -> str:
    """A reader's name for a type annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        names = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin in (tuple, list):
        inner = typing.get_args(tp)
        item = _describe(inner[0]).removeprefix("an ").removeprefix("a ") if inner else "value"
        return f"a list of {item}s"
    if origin is dict:
        return "a mapping"
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a text",
        Path: "a path",
        type(None): "null",
    }.get(tp, getattr(tp, "__name__", str(tp)))


def matches(value: Any, tp: Any) -> bool:
    """Whether ``value`` fits the annotation ``tp`` (bools are never numbers; ints are floats).

    Args:
        value: the value.
        tp: a resolved type annotation.
    """
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is Path:
        return isinstance(value, (str, Path))
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return (
            isinstance(value, (tuple, list)) and all(matches(v, args[0]) for v in value)
            if args
            else isinstance(value, (tuple, list))
        )
    if origin is dict:
        k, v = typing.get_args(tp) or (Any, Any)
        return isinstance(value, Mapping) and all(matches(a, k) and matches(b, v) for a, b in value.items())
    return isinstance(value, tp) if isinstance(tp, type) else True


def _is_tuple_field(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_is_tuple_field(a) for a in typing.get_args(tp))
    return origin is tuple


def _members(tp: Any) -> tuple[Any, ...]:
    """The alternatives of a union annotation (the annotation itself otherwise)."""
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def _section_type(tp: Any) -> type[Config] | None:
    """The ``Config`` subclass a field holds (alone or with null), else None."""
    found = [a for a in _members(tp) if isinstance(a, type) and issubclass(a, Config)]
    return found[0] if found else None


@dataclasses.dataclass(frozen=True)
class Config:
    """Base of every settings dataclass (see the module docstring)."""

    SECTION: ClassVar[str] = "settings"
    LEGACY: ClassVar[Mapping[str, LegacyKey]] = {}
    """Old key -> how it is read (see the module docstring)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            tp = hints.get(f.name, Any)
            if isinstance(value, list) and _is_tuple_field(tp):
                value = tuple(value)
                object.__setattr__(self, f.name, value)
            if isinstance(value, str) and Path in _members(tp) and str not in _members(tp):
                value = Path(value)
                object.__setattr__(self, f.name, value)
            if not matches(value, tp):
                self.fail(f.name, f"must be {_describe(tp)}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                self.fail(f.name, f"must be a finite number, got {value!r}")
            self._check_bounds(f, value)

    def _check_bounds(self, f: dataclasses.Field, value: Any) -> None:
        meta = f.metadata
        if value is None:
            return
        if "choices" in meta and value not in meta["choices"]:
            self.fail(f.name, f"must be one of {list(meta['choices'])}, got {value!r}")
        for key, ok, word in (
            ("ge", lambda v, b: v >= b, ">="),
            ("gt", lambda v, b: v > b, ">"),
            ("le", lambda v, b: v <= b, "<="),
            ("lt", lambda v, b: v < b, "<"),
        ):
            if key in meta and isinstance(value, (int, float)) and not ok(value, meta[key]):
                self.fail(f.name, f"must be {word} {meta[key]}, got {value!r}")

    @classmethod
    def qualified(cls, key: str) -> str:
        """How messages name a key (``section.key``).

        Args:
            key: the field name.
        """
        return f"{cls.SECTION}.{key}"

    def fail(self, key: str, reason: str) -> typing.NoReturn:
        """Raise the one-line error for a bad value.

        Args:
            key: the field name.
            reason: what is wrong and what is allowed.
        """
        raise ConfigError(f"{self.qualified(key)} {reason}")

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any] | None, where: str | None = None) -> C:
        """Build from a mapping: unknown keys, types and ranges checked; missing keys are defaults.

        Args:
            data: the settings (None: all defaults).
            where: the file or job the settings come from, for messages.
        """
        suffix = f" (in {where})" if where else ""
        if data is None:
            data = {}
        if isinstance(data, cls):
            return data
        if not isinstance(data, Mapping):
            raise ConfigError(f"{cls.SECTION} settings must be a mapping, got {type(data).__name__}{suffix}")
        data = cls._read_legacy(data, suffix)
        fields = dataclasses.fields(cls)
        known = [f.name for f in fields]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"unknown {cls.SECTION} setting(s) {unknown}{suffix}; known: {sorted(known)}")
        for f in fields:
            if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{cls.qualified(f.name)} is missing{suffix}")
        values = dict(data)
        hints = typing.get_type_hints(cls)
        for name, value in values.items():
            section = _section_type(hints.get(name))
            if section is not None and not isinstance(value, Config):
                values[name] = section.from_dict(value, where)  # null: the section's defaults
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{exc}{suffix}") from None

    @classmethod
    def _read_legacy(cls, data: Mapping[str, Any], suffix: str) -> Mapping[str, Any]:
        """``data`` with its legacy keys turned into their new settings (explicit new keys win)."""
        old = [k for k in cls.LEGACY if k in data]
        if not old:
            return data
        out = {k: v for k, v in data.items() if k not in cls.LEGACY}
        for key in old:
            legacy, value = cls.LEGACY[key], data[key]
            if not matches(value, legacy.type):
                raise ConfigError(f"{cls.qualified(key)} must be {_describe(legacy.type)}, got {value!r}{suffix}")
            for new_key, new_value in legacy.translate(value).items():
                out.setdefault(new_key, new_value)
            line = f"{cls.qualified(key)} is deprecated and will be removed in the next release; {legacy.advice}"
            if line not in _WARNED:
                _WARNED.add(line)
                log.warning("%s%s", line, suffix)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-friendly dict (tuples as lists, paths as text)."""

        def plain(v: Any) -> Any:
            if isinstance(v, Config):
                return v.to_dict()
            if isinstance(v, Path):
                return str(v)
            if isinstance(v, (tuple, list)):
                return [plain(x) for x in v]
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            return v

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self: C, **changes: Any) -> C:
        """A copy with some settings changed (validated again).

        Args:
            changes: field -> new value.
        """
        return type(self).from_dict({**self.to_dict(), **changes})

    @classmethod
    def as_keywords(cls, *extra: inspect.Parameter) -> inspect.Signature:
        """A constructor signature taking every setting as a keyword argument with its default (a settings
        section: None, its defaults), then ``extra``: what a component whose ``__init__`` takes
        ``**settings`` shows to NVFlare's job exporter and to readers, so the settings are declared once, here.

        Args:
            extra: further keyword-only parameters (the component's own).
        """
        hints = typing.get_type_hints(cls)
        params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        for f in dataclasses.fields(cls):
            section = _section_type(hints.get(f.name)) is not None
            default = None if section or f.default is dataclasses.MISSING else f.default
            annotation = "dict | None" if section else f.type
            params.append(
                inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
            )
        return inspect.Signature([*params, *extra], return_annotation="None")
