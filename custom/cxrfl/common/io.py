"""Files of a run, one helper each: JSON records, atomic writes, torch files, parameters as numpy,
digests, names used as path components.

Framework-free; every method, the NVFlare glue and the benchmarks write through these. Torch files
are written so that :func:`torch_load` reads them with ``weights_only=True``: nothing cxrfl reads
back (a resume state, a site's state, a checkpoint) is unpickled as code.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.errors import ConfigError, StorageError

_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


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

    Raises:
        StorageError: the file could not be written (disk full, no permission ...): one line naming it.
    """
    path = Path(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise StorageError(_cannot_write(path, exc)) from exc
        raise
    return path


def _cannot_write(path: Path, exc: OSError) -> str:
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    why, todo = (
        ("the disk is full", "free space on it")
        if full
        else (exc.strerror or str(exc), "check that folder's permissions and free space")
    )
    return f"cannot write {path}: {why}; {todo}, then run again (an earlier version of the file, if any, is unchanged)"


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON, atomically (numpy values converted).

    Args:
        path: the ``.json`` file.
        obj: the object.
    """
    text = json.dumps(obj, indent=2, default=json_default)
    return atomic_write(path, lambda f: f.write(text), mode="w")


def weights_only_values(obj: Any) -> Any:
    """``obj`` with numpy arrays as tensors (lists for non-numeric ones), numpy scalars as Python
    numbers and paths as strings: what :func:`torch_load` (``weights_only=True``) reads back.
    Containers in which nothing changes are returned as they are (a state dict keeps its metadata).

    Args:
        obj: tensors and plain values in dicts, lists and tuples.
    """
    if isinstance(obj, np.ndarray):
        return torch.tensor(obj) if obj.dtype.kind in "biufc" else obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, dict):
        out = {k: weights_only_values(v) for k, v in obj.items()}
        return obj if all(out[k] is v for k, v in obj.items()) else out
    if isinstance(obj, (list, tuple)):
        items = [weights_only_values(v) for v in obj]
        same = all(a is b for a, b in zip(items, obj))
        return obj if same else tuple(items) if isinstance(obj, tuple) else items
    return obj


def link_or_copy(source: str | Path, dest: str | Path) -> Path:
    """Make ``dest`` a hard link to ``source`` (no bytes written), a copy where links cannot be made
    (another file system); an existing ``dest`` is replaced atomically.

    Files written by :func:`atomic_write` are replaced by renaming, never rewritten in place, so the
    link keeps the content ``source`` had when it was made.

    Args:
        source: an existing file.
        dest: the new name (folders created).

    Raises:
        StorageError: it could not be made (disk full, no permission ...): one line naming it.
    """
    source, dest = Path(source), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.link")
    try:
        tmp.unlink(missing_ok=True)
        os.link(source, tmp)
        os.replace(tmp, dest)
        return dest
    except OSError:
        tmp.unlink(missing_ok=True)
    with source.open("rb") as src:
        return atomic_write(dest, lambda f: shutil.copyfileobj(src, f))


def torch_save(path: str | Path, obj: Any) -> Path:
    """``torch.save`` atomically, of :func:`weights_only_values` of ``obj``.

    Args:
        path: the file.
        obj: what to save (tensors and plain values; numpy values are converted).

    Raises:
        StorageError: the file could not be written.
    """
    plain = weights_only_values(obj)
    return atomic_write(path, lambda f: torch.save(plain, f))


def torch_load(path: str | Path, what: str, remedy: str, map_location: str | torch.device = "cpu") -> Any:
    """Read a torch file without running code in it (``weights_only=True``: tensors and plain values).

    Args:
        path: the file.
        what: what it is, for the message (``resume state``, ``checkpoint`` ...).
        remedy: what to do when it cannot be read.
        map_location: where tensors are loaded.

    Raises:
        ConfigError: missing, damaged, or holding other Python objects (one line: the file and ``remedy``).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols, which advise weights_only=False
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = (
            "it holds Python objects besides tensors and plain values (written by an older cxrfl or another "
            "program; not loaded, as unpickling them could run code)"
            if "Weights only load failed" in str(exc)
            else "it is damaged or not a torch file (UnpicklingError)"
        )
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
    except Exception as exc:  # torch raises many kinds for a truncated or foreign file
        reason = f"it is damaged or not a torch file ({type(exc).__name__})"
    raise ConfigError(f"{what} {path} cannot be read: {reason}; {remedy}")


def plain_name(value: Any, setting: str, hint: str) -> str:
    """``value`` checked as one path component of cxrfl's own (a job id, a run key): letters, digits,
    ``.``, ``_`` and ``-``, starting with a letter or digit; no folder, no ``..``.

    Args:
        value: the value.
        setting: its name, for the message.
        hint: what to give instead.

    Raises:
        ConfigError: anything else.
    """
    text = str(value)
    if not _PLAIN_NAME.fullmatch(text):
        raise ConfigError(
            f"{setting}={text!r} is not a plain name (letters, digits, '.', '_', '-'; no folder, "
            f"at most 128 characters): {hint}"
        )
    return text


def owner_only(path: str | Path, *, up_to: str | Path | None = None) -> Path:
    """Make a run file (mode 0o600) or folder (0o700) readable and writable by its owner only.

    For records that name which sites hold which classes (the server's ``rounds.jsonl``,
    ``evaluation.json``, models): no other local user may read them (docs/security.md).

    Args:
        path: an existing file or folder.
        up_to: a folder above ``path``: every folder from ``path`` up to it (included) too.
    """
    path = Path(path)
    top = Path(up_to) if up_to is not None else path
    for p in [path, *path.parents]:
        p.chmod(0o700 if p.is_dir() else 0o600)
        if p == top or top not in p.parents:
            break
    return path


def to_numpy(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A state dict as C-contiguous CPU numpy arrays (what travels over the wire; a channels-last
    tensor becomes a plain row-major array).

    Args:
        params: name -> tensor or array.
    """
    return {
        k: (v.detach().cpu().contiguous().numpy() if torch.is_tensor(v) else np.asarray(v, order="C"))
        for k, v in params.items()
    }


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
