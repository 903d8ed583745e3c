"""Shared fixtures: where the real NIH data lives (../shared/data beside the checkout)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real data folder; tests that need it skip with a clear message where it is absent."""
    if not (SHARED_DATA / "nih1000").is_dir():
        pytest.skip(f"real NIH data not found at {SHARED_DATA} (the shared/ folder beside the checkout)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO
