"""Files of a run, one helper each: JSON records, atomic writes, parameters as numpy, digests.

Framework-free; every method, the NVFlare glue and the benchmarks write through these.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch


def json_default(o: Any) -> Any:
    """``json.dumps`` fallback: numpy scalars and arrays as Python values, paths and anything else as ``str``."""
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.bool_):
        return bool(o)
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

    Args:
        path: the ``.jsonl`` file.
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


def atomic_write(path: str | Path, write: Callable[[Any], None], mode: str = "wb") -> Path:
    """Write a file so that readers see the old or the new content, never a part (temp file, fsync, rename).

    Args:
        path: the file (folders created).
        write: called with the open temporary file.
        mode: ``wb`` or ``w``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON, atomically (numpy values converted).

    Args:
        path: the ``.json`` file.
        obj: the object.
    """
    text = json.dumps(obj, indent=2, default=json_default)
    return atomic_write(path, lambda f: f.write(text), mode="w")


def torch_save(path: str | Path, obj: Any) -> Path:
    """``torch.save`` atomically.

    Args:
        path: the file.
        obj: what to save.
    """
    return atomic_write(path, lambda f: torch.save(obj, f))


def to_numpy(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A state dict as C-contiguous CPU numpy arrays (what travels over the wire; a channels-last
    tensor becomes a plain row-major array).

    Args:
        params: name -> tensor or array.
    """
    return {k: (v.detach().cpu().contiguous().numpy() if torch.is_tensor(v) else np.asarray(v, order="C"))
            for k, v in params.items()}


def params_digest(params: Mapping[str, Any]) -> str:
    """SHA-256 of a parameter dict (names, dtypes, shapes and bytes, in sorted name order).

    Args:
        params: name -> tensor or array.
    """
    h = hashlib.sha256()
    for k in sorted(params):
        v = params[k]
        a = np.ascontiguousarray(v.detach().cpu().numpy() if torch.is_tensor(v) else np.asarray(v))
        h.update(k.encode())
        h.update(str(a.dtype).encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()
