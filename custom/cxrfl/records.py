"""JSON records of a run (round records, evaluation reports): numpy-aware, append-only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def json_default(o: Any) -> Any:
    """``json.dumps`` fallback: numpy scalars and arrays as Python values, anything else as ``str``."""
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def append_record(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line to ``path`` (folders created).

    Args:
        path: a ``.jsonl`` file.
        record: the record.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, default=json_default) + "\n")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a ``.jsonl`` file written by :func:`append_record` ([] if absent).

    A last line cut short by a crash is ignored.
    """
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
