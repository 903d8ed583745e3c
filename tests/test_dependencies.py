"""The declared dependencies: installed versions meet the pins, and the pins are what the code needs."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli
    import tomli as tomllib

NEEDED = {"pydicom": ("3.0", "cxrfl.data.images imports pydicom.pixels (new in pydicom 3.0)")}
"""Package -> the lowest version with an API the code uses, and which."""

GPL = {"pylibjpeg-libjpeg"}
"""GPL-licensed packages: never a default dependency of this Apache-2.0 package (an extra at most)."""


def project(repo_root: Path) -> dict:
    return tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]


def requirements(repo_root: Path, extra: str | None = None) -> dict[str, Requirement]:
    declared = project(repo_root)["optional-dependencies"][extra] if extra else project(repo_root)["dependencies"]
    return {Requirement(r).name.lower(): Requirement(r) for r in declared}


def lowest(req: Requirement) -> Version:
    """The lowest version a pin allows (its ``>=`` or ``==`` bound)."""
    bounds = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert bounds, f"{req} has no lower bound"
    return max(bounds)


@pytest.mark.parametrize("extra", [None, "test"])
def test_installed_versions_meet_the_pins(repo_root: Path, extra: str | None) -> None:
    for name, req in requirements(repo_root, extra).items():
        if req.marker is not None and not req.marker.evaluate():
            continue  # e.g. tomli on Python >= 3.11
        installed = importlib.metadata.version(name)
        assert req.specifier.contains(installed, prereleases=True), f"{name} {installed} does not meet {req}"


def test_pins_are_at_least_what_the_code_uses(repo_root: Path) -> None:
    reqs = requirements(repo_root)
    for name, (version, why) in NEEDED.items():
        assert lowest(reqs[name]) >= Version(version), f"{reqs[name]} is too low: {why}"


def test_pins_cover_what_pydicom_asks_of_its_decoder_plugins(repo_root: Path) -> None:
    from pydicom.pixels.decoders import gdcm, pylibjpeg

    reqs = {**requirements(repo_root, "gpl-decoders"), **requirements(repo_root)}
    for plugin in (gdcm, pylibjpeg):
        for syntax, needs in plugin.DECODER_DEPENDENCIES.items():
            for need in map(Requirement, needs):
                name = {"gdcm": "python-gdcm"}.get(need.name, need.name)  # pydicom names GDCM by its module
                assert name in reqs, f"{name} (for {syntax.name}) is not a declared dependency"
                assert need.specifier.contains(lowest(reqs[name])), f"{reqs[name]} allows less than {need}"


def test_every_dependency_has_a_lower_bound_and_none_is_gpl_by_default(repo_root: Path) -> None:
    """Issue 40 point 11: pylibjpeg-libjpeg (GPL-3.0) was a hard dependency of this Apache-2.0 package."""
    extras = project(repo_root)["optional-dependencies"]
    for extra in (None, *extras):
        for req in requirements(repo_root, extra).values():
            lowest(req)
    assert not GPL & set(requirements(repo_root)), "a GPL package is a default dependency"
    assert GPL <= set(requirements(repo_root, "gpl-decoders"))


def test_what_the_code_imports_is_declared_and_mlflow_is_an_extra(repo_root: Path) -> None:
    """Issue 40 point 11: psutil was imported (deploy, bench) but not declared; mlflow, needed only by
    the optional MLflow tracking, was a hard dependency."""
    reqs = requirements(repo_root)
    assert "psutil" in reqs
    assert "fire" in reqs  # `python -m monai.bundle run` (README, cxrfl.bundle) imports fire
    assert "mlflow" not in reqs and "mlflow" in requirements(repo_root, "mlflow")
    assert "mlflow" in requirements(repo_root, "test")  # the tracking tests need it


def test_mlflow_tracking_without_mlflow_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40 point 11: asking for MLflow tracking without mlflow installed says what to install."""
    import sys

    from cxrfl.errors import ConfigError
    from cxrfl.fl.recipes import SurgicalAggregationRecipe

    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now fails as if it were not installed
    with pytest.raises(ConfigError, match=r"job.tracking 'mlflow' needs MLflow: pip install 'cxrfl\[mlflow\]'"):
        SurgicalAggregationRecipe(tracking=("tensorboard", "mlflow"))
    SurgicalAggregationRecipe(tracking=("tensorboard",))  # the default tracking needs no MLflow
