"""The declared dependencies: installed versions meet the pins, and the pins are what the code needs."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

NEEDED = {"pydicom": ("3.0", "cxrfl.data.images imports pydicom.pixels (new in pydicom 3.0)")}
"""Package -> the lowest version with an API the code uses, and which."""


def requirements(repo_root: Path, extra: str | None = None) -> dict[str, Requirement]:
    project = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    declared = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return {Requirement(r).name.lower(): Requirement(r) for r in declared}


def lowest(req: Requirement) -> Version:
    """The lowest version a pin allows (its ``>=`` or ``==`` bound)."""
    bounds = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert bounds, f"{req} has no lower bound"
    return max(bounds)


@pytest.mark.parametrize("extra", [None, "test"])
def test_installed_versions_meet_the_pins(repo_root: Path, extra: str | None) -> None:
    for name, req in requirements(repo_root, extra).items():
        installed = importlib.metadata.version(name)
        assert req.specifier.contains(installed, prereleases=True), f"{name} {installed} does not meet {req}"


def test_pins_are_at_least_what_the_code_uses(repo_root: Path) -> None:
    reqs = requirements(repo_root)
    for name, (version, why) in NEEDED.items():
        assert lowest(reqs[name]) >= Version(version), f"{reqs[name]} is too low: {why}"


def test_pins_cover_what_pydicom_asks_of_its_decoder_plugins(repo_root: Path) -> None:
    from pydicom.pixels.decoders.pylibjpeg import DECODER_DEPENDENCIES

    reqs = requirements(repo_root)
    for syntax, needs in DECODER_DEPENDENCIES.items():
        for need in map(Requirement, needs):
            assert need.name in reqs, f"{need.name} (for {syntax.name}) is not a declared dependency"
            assert need.specifier.contains(lowest(reqs[need.name])), f"{reqs[need.name]} allows less than {need}"
