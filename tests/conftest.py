"""Shared fixtures: where the real NIH data lives (../shared/data beside the checkout)."""

from __future__ import annotations

import contextlib
import os
import pickletools
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def require_data(present: bool, message: str) -> None:
    """Skip the calling test with ``message`` where its data is absent, but fail it when CI is set
    (a CI run that silently skipped the real-data tests would prove nothing about them).

    Args:
        present: whether the data the test needs is there.
        message: what is missing and where it was looked for.
    """
    if present:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{message}; CI must have it")
    pytest.skip(message)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real data folder; tests that need it skip with a clear message where it is absent (fail in CI)."""
    require_data(
        (SHARED_DATA / "nih1000").is_dir(),
        f"real NIH data not found at {SHARED_DATA} (the shared/ folder beside the checkout)",
    )
    return SHARED_DATA


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def _texts(path: Path) -> list[bytes]:
    """The bytes a name could hide in: the file, each member of a zip (torch checkpoints are zips), and every
    string of a pickle (read with pickletools, never unpickled): in a pickle a string is followed by an opcode
    that may be a letter (``q``, BINPUT), so a whole-word search of the raw bytes misses it."""
    data = path.read_bytes()
    parts = [data]
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            parts += [z.read(name) for name in z.namelist()]
    for part in list(parts):
        if part[:1] == b"\x80":  # a pickle's PROTO opcode
            with contextlib.suppress(Exception):  # not a pickle after all: its raw bytes were searched
                parts += [
                    arg.encode() if isinstance(arg, str) else bytes(arg)
                    for _, arg, _ in pickletools.genops(part)
                    if isinstance(arg, (str, bytes, bytearray))
                ]
    return parts


def names_in(path: Path, names: list[str]) -> list[str]:
    """Class names (or their NIH underscore spellings) a file mentions as whole words (a torch checkpoint's
    and a pickle's strings included)."""
    texts = _texts(path)
    found = []
    for name in names:
        for spelling in {name, name.replace(" ", "_")}:
            pattern = re.compile(rb"(?<![A-Za-z])" + re.escape(spelling.encode()) + rb"(?![A-Za-z])")
            if any(pattern.search(t) for t in texts):
                found.append(spelling)
    return found


@pytest.fixture(scope="module", autouse=True)
def module_tmp_cleanup(request, tmp_path_factory):
    """Remove a module's ``tmp_path_factory`` folders once its tests all passed: the suite writes many
    DenseNet checkpoints (about 14 GB kept to the session's end otherwise, more than a CI disk may
    have free). Per-test ``tmp_path`` folders go right after a passing test
    (``tmp_path_retention_policy = "failed"`` in pyproject.toml); a failing module keeps everything."""
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for path in set(base.iterdir()) - before:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): on a
    shared 2-core machine two threads make a tiny DenseNet step up to 20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
