"""Quality gates: ruff (lint and format) on the configured tree and mypy on the package, as CI runs them.

The tools are the test environment's own (the ``test`` extra), run from the repo root with the settings in
pyproject.toml.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def _report(proc: subprocess.CompletedProcess[str]) -> str:
    return f"`{' '.join(map(str, proc.args[2:]))}` exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("args", [("ruff", "check"), ("ruff", "format", "--check")], ids=["lint", "format"])
def test_ruff_is_clean(args: tuple[str, ...]) -> None:
    proc = _run(*args)
    assert proc.returncode == 0, _report(proc)


def test_mypy_is_clean() -> None:
    proc = _run("mypy")
    assert proc.returncode == 0, _report(proc)
