"""Site config loading and validation (cxrfl.data.site_config), and the shipped example configs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from cxrfl.data.site_config import load_site_config, site_config_from_dict
from cxrfl.errors import ConfigError

MINIMAL = {"site": "a", "dataset": {"format": "nih", "labels": "labels.csv", "images": "img"}}


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    cfg = load_site_config(write(tmp_path, MINIMAL))
    assert cfg.dataset.labels == tmp_path.resolve() / "labels.csv"
    assert cfg.dataset.images == tmp_path.resolve() / "img"
    assert (cfg.split.train, cfg.split.val, cfg.split.test, cfg.split.seed) == (0.7, 0.1, 0.2, 0)
    assert cfg.dataset.uncertain == "zeros" and cfg.bad_images == "skip" and cfg.max_bad_fraction == 0.05
    assert cfg.classes is None and cfg.label_map == {} and cfg.drop == ()


def test_full_config_round_trips_through_to_dict(tmp_path: Path) -> None:
    data = {
        "site": "b",
        "dataset": {
            "format": "chexpert",
            "labels": "/x/train.csv",
            "images": "/x",
            "uncertain": "ignore",
            "views": ["pa"],
        },
        "classes": ["Edema"],
        "label_map": {"Effusion": "Pleural Effusion"},
        "drop": ["Fracture"],
        "split": {"train": 0.8, "val": 0.1, "test": 0.1, "seed": 3},
        "bad_images": "error",
    }
    cfg = load_site_config(write(tmp_path, data))
    assert cfg.dataset.views == ("PA",) and cfg.classes == ("Edema",) and cfg.split.seed == 3
    assert site_config_from_dict(cfg.to_dict()) == dataclasses.replace(cfg, source=None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "red"}, "unknown site config setting(s) ['colour']"),
        ({"dataset": {**MINIMAL["dataset"], "imgs": "x"}}, "unknown dataset setting(s) ['imgs']"),
        ({"split": {"train": 0.7, "valid": 0.3}}, "unknown split setting(s) ['valid']"),
        ({"split": {"train": 0.7, "val": 0.2, "test": 0.2}}, "split fractions must sum to 1"),
        ({"split": {"train": 0.0, "val": 0.5, "test": 0.5}}, "split.train must be > 0.0, got 0.0"),
        ({"split": {"train": 1.2, "val": -0.2, "test": 0.0}}, "split.train must be <= 1.0, got 1.2"),
        ({"split": {"seed": "abc"}}, "split.seed must be an integer, got 'abc'"),
        ({"split": {"seed": -1}}, "split.seed must be >= 0, got -1"),
        ({"split": 0.7}, "split settings must be a mapping, got float"),
        ({"dataset": {**MINIMAL["dataset"], "format": "dicomdir"}}, "dataset.format must be one of"),
        ({"dataset": {**MINIMAL["dataset"], "uncertain": "maybe"}}, "dataset.uncertain must be one of"),
        ({"dataset": {**MINIMAL["dataset"], "views": "PA"}}, "dataset.views must be a list of texts or null, got 'PA'"),
        ({"dataset": {**MINIMAL["dataset"], "labels": 5}}, "dataset.labels must be a path, got 5"),
        ({"dataset": {**MINIMAL["dataset"], "path_column": ["a"]}}, "dataset.path_column must be a text"),
        ({"dataset": "labels.csv"}, "dataset settings must be a mapping, got str"),
        ({"dataset": {"format": "nih", "images": "x"}}, "dataset.labels is missing"),
        ({"bad_images": "ignore"}, "bad_images must be one of ['skip', 'error'], got 'ignore'"),
        ({"max_bad_fraction": 1.5}, "max_bad_fraction must be <= 1.0, got 1.5"),
        ({"max_bad_fraction": "5%"}, "max_bad_fraction must be a number, got '5%'"),
        ({"max_bad_fraction": True}, "max_bad_fraction must be a number, got True"),
        ({"classes": "Cardiomegaly"}, "classes must be a list of texts or null, got 'Cardiomegaly'"),
        ({"drop": "Fracture"}, "drop must be a list of texts, got 'Fracture'"),
        ({"label_map": {"Effusion": 1}}, "label_map must be a mapping"),
        ({"label_map": ["Effusion"]}, "label_map must be a mapping"),
        ({"site": 12}, "site must be a text, got 12"),
        ({"site": " "}, "site must be a non-empty name"),
    ],
)
def test_invalid_configs_name_the_file_and_the_key(tmp_path: Path, change: dict, message: str) -> None:
    path = write(tmp_path, {**MINIMAL, **change})
    with pytest.raises(ConfigError) as info:
        load_site_config(path)
    text = str(info.value)
    assert text.startswith(message) and f"(in {path})" in text and "\n" not in text


def test_yaml_lists_views_and_empty_keys_read_as_meant(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text(
        "site: a\ndataset:\n  format: nih\n  labels: labels.csv\n  images: img\n  views: [pa, ' Ap']\n"
        "classes: [Cardiomegaly]\nlabel_map:\ndrop:\nsplit: {seed: 7}\nmax_bad_fraction: 0.1\n"
    )
    cfg = load_site_config(path)
    assert cfg.dataset.views == ("PA", "AP") and cfg.classes == ("Cardiomegaly",) and cfg.split.seed == 7
    assert cfg.label_map == {} and cfg.drop == ()  # a key without a value is its default
    assert (cfg.split.train, cfg.max_bad_fraction) == (0.7, 0.1)


def test_missing_or_broken_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_site_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("site: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_site_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_site_config(bad)


@pytest.mark.parametrize("name", ["nih", "chexpert", "mimic", "csv"])
def test_example_configs_are_valid(repo_root: Path, name: str) -> None:
    cfg = load_site_config(repo_root / "site_configs" / "examples" / f"{name}.yaml")
    assert cfg.dataset.format == name
    assert cfg.dataset.labels.is_absolute() and cfg.dataset.images.is_absolute()
