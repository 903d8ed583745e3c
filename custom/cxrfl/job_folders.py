"""The app folders of an exported NVFlare job folder (no torch or NVFlare import: the deploy CLI reads it)."""

from __future__ import annotations

import json
from pathlib import Path


def app_dirs(job: str | Path) -> list[Path]:
    """The app folders of an exported job (``app``, or ``app_server`` and one per named site), as its deploy_map
    lists them.

    Args:
        job: the job folder.
    """
    return [Path(job) / app for app in json.loads((Path(job) / "meta.json").read_text())["deploy_map"]]
