"""Typed, validated site configuration (one YAML file per site).

Example::

    site: hospital-a
    dataset:
      format: nih            # nih | chexpert | mimic | csv | folders | categorical | registry
      labels: Data_Entry_2017_v2020.csv
      images: images/
    classes: [Atelectasis, Cardiomegaly]   # optional subset, default: all findings of the file
    label_map: {}                          # optional renames to canonical names
    drop: []                               # optional label columns to ignore
    split: {train: 0.7, val: 0.1, test: 0.2, seed: 0}

Relative paths are resolved against the folder of the config file; a key written without a value
means its default. Defaults live here only. Every value is type-checked (:class:`cxrfl.common.config.Config`):
a wrong one is a one-line :class:`ConfigError` naming the file and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from cxrfl.common.config import Config
from cxrfl.data.subgroups import SUBGROUP_FIELDS
from cxrfl.errors import ConfigError

FORMATS = ("nih", "chexpert", "mimic", "csv", "folders", "categorical", "registry")
UNCERTAIN_POLICIES = ("zeros", "ones", "ignore")
BAD_IMAGE_POLICIES = ("skip", "error")
OVERLAP_POLICIES = ("refuse", "move", "drop", "resplit")
_PATH_KEYS = ("labels", "images", "metadata", "split_file")
_MAPPING_KEYS = ("class_folders", "split_folders", "values")  # YAML may write their keys as numbers
_CSV_FORMATS = ("csv", "categorical", "registry")
_FORMAT_KEYS = {  # settings read by some formats only: set for another format, they are an error
    "image_suffix": _CSV_FORMATS,
    "class_folders": ("folders",),
    "split_folders": ("folders",),
    "patient_pattern": ("folders",),
    "subclasses": ("folders",),
    "finding_column": ("categorical",),
    "values": ("categorical",),
    "unlabelled_values": ("categorical",),
    "site_label": ("registry",),
    "derived": ("registry",),
    "subgroups": _CSV_FORMATS,
}


@dataclass(frozen=True)
class DatasetConfig(Config):
    """Where a site's data is and how to read it.

    Args:
        format: one of ``nih``, ``chexpert``, ``mimic``, ``csv``, ``folders``, ``categorical``, ``registry``.
        labels: the label file as the dataset publishes it (MIMIC: the ``*-chexpert.csv``); none for
            ``folders``.
        images: the image root folder.
        uncertain: CheXpert/MIMIC policy for ``-1`` labels: ``zeros`` (the papers' choice),
            ``ones`` or ``ignore`` (masked out of the loss and metrics).
        views: view positions to keep, upper-cased (``None``: frontal views, i.e. PA and AP).
        metadata: MIMIC ``mimic-cxr-2.0.0-metadata.csv`` (view positions per image).
        split_file: MIMIC ``mimic-cxr-2.0.0-split.csv`` or any CSV with a ``split`` column;
            when given, its splits are used instead of a random patient split.
        path_column: generic CSV: the column with image paths relative to ``images``.
        patient_column: generic CSV: the patient id column (default: one patient per image).
        split_column: generic CSV: an optional column with train/val/test per row.
        allow_outside_images: read images whose path leaves ``images`` (an absolute path, ``..``
            or a symlink pointing elsewhere); by default each such row is refused with a warning.
        overlap: a patient in two splits of a given split: ``refuse``, ``move`` (to the patient's
            first split, train before val before test), ``drop`` (the images outside it) or
            ``resplit`` (ignore the given split).
        image_suffix: csv, categorical, registry: appended to each ``path_column`` value (``.png``).
        class_folders: folders: class folder name -> class (null: no finding).
        split_folders: folders: split folder name -> ``train``, ``val`` or ``test`` (none: class
            folders directly under ``images``, no given split).
        patient_pattern: folders: a regular expression with a group ``(?P<patient>...)`` searched
            in each file name (none: each image its own patient).
        subclasses: folders: class folder -> {file name pattern -> sub-class}.
        finding_column: categorical: the column with one finding per image.
        values: categorical: finding value -> class (null: no finding).
        unlabelled_values: categorical: values meaning "not labelled" (all classes masked).
        site_label: registry: the class every image of the site has.
        derived: registry: class -> column; positive where the column is filled.
        subgroups: csv, categorical, registry: subgroup field (``sex``, ``age``, ``view``) -> column
            (:mod:`cxrfl.data.subgroups`; nih, chexpert and mimic read their own columns).
    """

    SECTION: ClassVar[str] = "dataset"
    format: str = field(metadata={"choices": FORMATS})
    images: Path
    labels: Path | None = None
    uncertain: str = field(default="zeros", metadata={"choices": UNCERTAIN_POLICIES})
    views: tuple[str, ...] | None = None
    metadata: Path | None = None
    split_file: Path | None = None
    path_column: str = "path"
    patient_column: str | None = None
    split_column: str | None = None
    allow_outside_images: bool = False
    overlap: str = field(default="refuse", metadata={"choices": OVERLAP_POLICIES})
    image_suffix: str = ""
    class_folders: dict[str, str | None] | None = None
    split_folders: dict[str, str] | None = None
    patient_pattern: str | None = None
    subclasses: dict[str, dict[str, str]] = field(default_factory=dict)
    finding_column: str | None = None
    values: dict[str, str | None] = field(default_factory=dict)
    unlabelled_values: tuple[str, ...] = ()
    site_label: str | None = None
    derived: dict[str, str] = field(default_factory=dict)
    subgroups: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.labels, (str, Path, type(None))):  # null only means "not given" (folders)
            self.fail("labels", f"must be a path, got {self.labels!r}")
        super().__post_init__()
        if self.views is not None:
            object.__setattr__(self, "views", tuple(v.strip().upper() for v in self.views))
        for key, formats in _FORMAT_KEYS.items():
            if self.format not in formats and getattr(self, key) not in (None, "", (), {}):
                self.fail(key, f"is only read for format {' or '.join(formats)}, not {self.format}")
        required = {
            "folders": ("class_folders",),
            "categorical": ("labels", "finding_column", "values"),
            "registry": ("labels",),
        }.get(self.format, ("labels",))
        for key in required:
            if getattr(self, key) in (None, {}):
                self.fail(key, f"is missing (format {self.format} needs it)")
        unknown = [k for k in self.subgroups if k not in SUBGROUP_FIELDS]
        if unknown:
            self.fail("subgroups", f"has key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(SUBGROUP_FIELDS)}")
        if self.format == "registry" and not self.site_label and not self.derived:
            self.fail("site_label", "or dataset.derived is required for format registry")
        self._check_folders()

    def _check_folders(self) -> None:
        """The folders layout's patterns compile, sub-classes belong to a class folder, splits are named."""
        for folder, split in (self.split_folders or {}).items():
            if split not in ("train", "val", "test"):
                self.fail("split_folders", f"maps folder {folder!r} to {split!r}; use train, val or test")
        if (
            self.patient_pattern is not None
            and "patient" not in _compiled(self, "patient_pattern", self.patient_pattern).groupindex
        ):
            self.fail("patient_pattern", f"{self.patient_pattern!r} has no named group (?P<patient>...)")
        for folder, patterns in self.subclasses.items():
            if folder not in (self.class_folders or {}):
                self.fail("subclasses", f"names folder {folder!r}, which is not in dataset.class_folders")
            if not (self.class_folders or {})[folder]:
                self.fail("subclasses", f"names {folder!r}, a no-finding folder: it has no sub-classes")
            for pattern in patterns:
                _compiled(self, "subclasses", pattern)

    @property
    def label_source(self) -> Path:
        """The file the labels come from (the image folder for ``folders``), for messages."""
        return self.labels if self.labels is not None else self.images


def _compiled(config: Config, key: str, pattern: str) -> re.Pattern[str]:
    """A regular expression of a setting, or the one-line error naming the setting."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        config.fail(key, f"{pattern!r} is not a valid regular expression: {exc}")


@dataclass(frozen=True)
class SplitConfig(Config):
    """Patient-level split fractions and seed.

    Args:
        train: fraction of patients for training (> 0).
        val: fraction for validation.
        test: fraction for testing.
        seed: random seed of the split.
    """

    SECTION: ClassVar[str] = "split"
    train: float = field(default=0.7, metadata={"gt": 0.0, "le": 1.0})
    val: float = field(default=0.1, metadata={"ge": 0.0, "le": 1.0})
    test: float = field(default=0.2, metadata={"ge": 0.0, "le": 1.0})
    seed: int = field(default=0, metadata={"ge": 0})

    def __post_init__(self) -> None:
        super().__post_init__()
        if abs(self.train + self.val + self.test - 1.0) > 1e-6:
            raise ConfigError(
                f"split fractions must sum to 1 (got train={self.train}, val={self.val}, test={self.test})"
            )


@dataclass(frozen=True)
class SiteConfig(Config):
    """One site's data description.

    Args:
        site: the site name (as NVFlare knows it).
        dataset: see :class:`DatasetConfig`.
        classes: canonical names this site contributes (default: all findings of the file).
        label_map: file column -> canonical (or new) class name.
        drop: label columns (or classes) to ignore; see ``site_configs/README.md``.
        split: see :class:`SplitConfig`.
        bad_images: ``skip`` unreadable images (counted and reported) or ``error``.
        max_bad_fraction: above this fraction of skipped images the site stops with an error.
        min_class_images: fewer positive or negative images of a class in a split is reported.
        source: the YAML file this config was read from, if any.
    """

    SECTION: ClassVar[str] = "site config"
    site: str
    dataset: DatasetConfig
    classes: tuple[str, ...] | None = None
    label_map: dict[str, str] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    split: SplitConfig = field(default_factory=SplitConfig)
    bad_images: str = field(default="skip", metadata={"choices": BAD_IMAGE_POLICIES})
    max_bad_fraction: float = field(default=0.05, metadata={"ge": 0.0, "le": 1.0})
    min_class_images: int = field(default=5, metadata={"ge": 0})
    source: Path | None = None

    @classmethod
    def qualified(cls, key: str) -> str:
        """Top-level keys are named as written in the file (``max_bad_fraction``)."""
        return key

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.site.strip():
            self.fail("site", "must be a non-empty name")

    def to_dict(self) -> dict[str, Any]:
        """A plain, YAML-serialisable dict (paths as strings) to save with a run."""
        d = super().to_dict()
        d.pop("source")
        return d


def _without_empty(data: Any) -> Any:
    """A mapping without its keys written with no value (they mean the default)."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def site_config_from_dict(data: dict[str, Any], base_dir: Path | None = None, source: Path | None = None) -> SiteConfig:
    """Build and validate a :class:`SiteConfig` from a plain dict.

    Args:
        data: the parsed YAML mapping.
        base_dir: folder that relative paths are resolved against (default: cwd).
        source: the file it came from, for messages.
    """
    where = str(source) if source else "the site config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a YAML mapping with keys site, dataset, ...")
    data = _without_empty(data)
    if "source" in data:
        raise ConfigError(f"unknown site config setting(s) ['source'] (in {where})")
    base = Path(base_dir) if base_dir else Path.cwd()
    sections = {k: _without_empty(data[k]) for k in ("dataset", "split") if k in data}
    dataset = sections.get("dataset")
    if isinstance(dataset, dict):
        for key in _MAPPING_KEYS:
            if isinstance(dataset.get(key), dict):
                dataset[key] = {str(k) if isinstance(k, (int, float)) else k: v for k, v in dataset[key].items()}
        for key in _PATH_KEYS:
            if isinstance(dataset.get(key), str):  # other types are reported by DatasetConfig
                path = Path(dataset[key]).expanduser()
                dataset[key] = path if path.is_absolute() else base / path
    return SiteConfig.from_dict({**data, **sections, "source": source}, where)


def load_site_config(path: str | Path) -> SiteConfig:
    """Read and validate a site config YAML file.

    Args:
        path: the YAML file; relative paths inside it are resolved against its folder.

    Raises:
        ConfigError: the file is missing, not YAML, or its content is invalid.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"site config {path} does not exist; write one (see site_configs/README.md)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"site config {path} is not valid YAML: {exc}") from exc
    return site_config_from_dict(data, base_dir=path.parent.resolve(), source=path)
