"""Typed, validated site configuration (one YAML file per site).

Example::

    site: hospital-a
    dataset:
      format: nih            # nih | chexpert | mimic | csv
      labels: Data_Entry_2017_v2020.csv
      images: images/
    classes: [Atelectasis, Cardiomegaly]   # optional subset, default: all findings of the file
    label_map: {}                          # optional renames to canonical names
    drop: []                               # optional label columns to ignore
    split: {train: 0.7, val: 0.1, test: 0.2, seed: 0}

Relative paths are resolved against the folder of the config file. Defaults live here only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cxrfl.errors import ConfigError

FORMATS = ("nih", "chexpert", "mimic", "csv")
UNCERTAIN_POLICIES = ("zeros", "ones", "ignore")
BAD_IMAGE_POLICIES = ("skip", "error")


@dataclass(frozen=True)
class DatasetConfig:
    """Where a site's data is and how to read it.

    Args:
        format: one of ``nih``, ``chexpert``, ``mimic``, ``csv``.
        labels: the label file as the dataset publishes it (MIMIC: the ``*-chexpert.csv``).
        images: the image root folder.
        uncertain: CheXpert/MIMIC policy for ``-1`` labels: ``zeros`` (the papers' choice),
            ``ones`` or ``ignore`` (masked out of the loss and metrics).
        views: view positions to keep (``None``: frontal views, i.e. PA and AP).
        metadata: MIMIC ``mimic-cxr-2.0.0-metadata.csv`` (view positions per image).
        split_file: MIMIC ``mimic-cxr-2.0.0-split.csv`` or any CSV with a ``split`` column;
            when given, its splits are used instead of a random patient split.
        path_column: generic CSV: the column with image paths relative to ``images``.
        patient_column: generic CSV: the patient id column (default: one patient per image).
        split_column: generic CSV: an optional column with train/val/test per row.
    """

    format: str
    labels: Path
    images: Path
    uncertain: str = "zeros"
    views: tuple[str, ...] | None = None
    metadata: Path | None = None
    split_file: Path | None = None
    path_column: str = "path"
    patient_column: str | None = None
    split_column: str | None = None


@dataclass(frozen=True)
class SplitConfig:
    """Patient-level split fractions and seed.

    Args:
        train: fraction of patients for training.
        val: fraction for validation.
        test: fraction for testing.
        seed: random seed of the split.
    """

    train: float = 0.7
    val: float = 0.1
    test: float = 0.2
    seed: int = 0


@dataclass(frozen=True)
class SiteConfig:
    """One site's data description.

    Args:
        site: the site name (as NVFlare knows it).
        dataset: see :class:`DatasetConfig`.
        classes: canonical names this site contributes (default: all findings of the file).
        label_map: file column -> canonical (or new) class name.
        drop: label columns to ignore.
        split: see :class:`SplitConfig`.
        bad_images: ``skip`` unreadable images (counted and reported) or ``error``.
        max_bad_fraction: above this fraction of skipped images the site stops with an error.
        source: the YAML file this config was read from, if any.
    """

    site: str
    dataset: DatasetConfig
    classes: tuple[str, ...] | None = None
    label_map: dict[str, str] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    split: SplitConfig = field(default_factory=SplitConfig)
    bad_images: str = "skip"
    max_bad_fraction: float = 0.05
    source: Path | None = None

    def __post_init__(self) -> None:
        where = f" in {self.source}" if self.source else ""
        if not self.site or not isinstance(self.site, str):
            raise ConfigError(f"'site' must be a non-empty name{where}")
        ds = self.dataset
        if ds.format not in FORMATS:
            raise ConfigError(
                f"dataset.format {ds.format!r}{where} is not supported; use one of {', '.join(FORMATS)}"
            )
        if ds.uncertain not in UNCERTAIN_POLICIES:
            raise ConfigError(
                f"dataset.uncertain {ds.uncertain!r}{where}: use one of {', '.join(UNCERTAIN_POLICIES)}"
            )
        if self.bad_images not in BAD_IMAGE_POLICIES:
            raise ConfigError(f"bad_images {self.bad_images!r}{where}: use 'skip' or 'error'")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ConfigError(f"max_bad_fraction must be between 0 and 1{where}")
        s = self.split
        fractions = (s.train, s.val, s.test)
        if any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6 or s.train <= 0:
            raise ConfigError(
                f"split fractions{where} must be non-negative, train > 0, and sum to 1 "
                f"(got train={s.train}, val={s.val}, test={s.test})"
            )

    def to_dict(self) -> dict[str, Any]:
        """A plain, YAML-serialisable dict (paths as strings) to save with a run."""

        def conv(v: Any) -> Any:
            if isinstance(v, Path):
                return str(v)
            if isinstance(v, tuple):
                return [conv(x) for x in v]
            if isinstance(v, dict):
                return {k: conv(x) for k, x in v.items()}
            return v

        d = dataclasses.asdict(self)
        d.pop("source")
        return conv(d)


def _known_keys(cls: type, data: dict[str, Any], where: str, section: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)} - {"source"}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in {section} of {where}; "
            f"allowed: {', '.join(sorted(names))}"
        )


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
    _known_keys(SiteConfig, data, where, "the top level")
    if "site" not in data or "dataset" not in data:
        raise ConfigError(f"{where} needs at least 'site' and 'dataset' (format, labels, images)")
    ds = dict(data["dataset"] or {})
    _known_keys(DatasetConfig, ds, where, "'dataset'")
    for key in ("format", "labels", "images"):
        if key not in ds:
            raise ConfigError(f"dataset.{key} is missing in {where}")
    base = Path(base_dir) if base_dir else Path.cwd()

    def path(v: Any) -> Path | None:
        if v is None:
            return None
        p = Path(str(v)).expanduser()
        return p if p.is_absolute() else (base / p)

    for key in ("labels", "images", "metadata", "split_file"):
        if key in ds:
            ds[key] = path(ds[key])
    if ds.get("views") is not None:
        ds["views"] = tuple(str(v).upper() for v in ds["views"])
    split = dict(data.get("split") or {})
    _known_keys(SplitConfig, split, where, "'split'")
    try:
        return SiteConfig(
            site=str(data["site"]),
            dataset=DatasetConfig(**ds),
            classes=tuple(data["classes"]) if data.get("classes") else None,
            label_map={str(k): str(v) for k, v in (data.get("label_map") or {}).items()},
            drop=tuple(str(c) for c in (data.get("drop") or ())),
            split=SplitConfig(**split),
            bad_images=str(data.get("bad_images", "skip")),
            max_bad_fraction=float(data.get("max_bad_fraction", 0.05)),
            source=source,
        )
    except TypeError as exc:  # wrong value types reach the dataclass constructors
        raise ConfigError(f"invalid value in {where}: {exc}") from exc


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
