"""Bytes the surgical server writes per round (issue 43): the demo job's settings and data, in process.

Runs the server loop of ``jobs/surgical_agg`` (its ``config_fed_server.json`` settings, the simulator's
demo sites ``site-1`` / ``site-2``) for a few rounds and counts every byte cxrfl writes through
``cxrfl.common.io.atomic_write`` (every checkpoint, resume state and record file goes through it;
a hard link writes nothing), split into the server's files and the sites'. The same script runs on
any commit since the helper's name is unchanged, so "before" and "after" are two runs of it:

    python benchmarks/server_writes.py --rounds 3 --out benchmarks/results/server_writes/after.json
    git worktree add /tmp/before <commit>; PYTHONPATH=/tmp/before/custom python benchmarks/server_writes.py ...

Writes one JSON object: per server file, its bytes and the number of writes; the server's bytes in
each round (inside ``SurgicalServer._round``) and outside rounds (warm-up, final validation and
evaluation); the model size; the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import cxrfl.common.io as io_module
import torch
from cxrfl.common.io import read_records
from cxrfl.data.site import load_site
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.inprocess import run_surgical
from cxrfl.surgical.server import SurgicalServer
from cxrfl.synth import demo_site_config

REPO = Path(__file__).resolve().parents[1]


def demo_config(rounds: int, max_steps: int | None) -> SurgicalConfig:
    """The demo job's server settings, with ``rounds`` rounds, no early stop before them and the sites'
    local epochs capped at ``max_steps`` steps (None: the demo's; what the server writes does not depend on it)."""
    server = json.loads((REPO / "jobs" / "surgical_agg" / "app" / "config" / "config_fed_server.json").read_text())
    args = next(w["args"] for w in server["workflows"] if w["id"] == "controller")
    known = {f.name for f in dataclasses.fields(SurgicalConfig)}
    settings = {k: v for k, v in args.items() if k in known}
    train = {**settings["train_config"], "max_steps_per_epoch": max_steps}
    return SurgicalConfig.from_dict(
        {**settings, "train_config": train, "num_rounds": rounds, "patience": rounds + 1, "evaluate_test": False}
    )


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None, help="cap of each local epoch (default: the demo's)")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def _commit() -> str:
    """The short commit of the checkout the measured code comes from."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=Path(io_module.__file__).parent, capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    """Run, count, write the JSON."""
    args = _arguments()
    written: dict[str, list[int]] = defaultdict(list)
    by_phase: dict[str, int] = defaultdict(int)
    phase = ["outside rounds"]
    original, original_round = io_module.atomic_write, SurgicalServer._round

    def counting(path: Any, write: Any, mode: str = "wb") -> Path:
        result = original(path, write, mode)
        written[str(Path(path))].append(Path(path).stat().st_size)
        if is_server(str(path)):
            by_phase[phase[0]] += Path(path).stat().st_size
        return result

    def is_server(path: str) -> bool:  # the sites keep their state under out/sites (in-process runs)
        return path.startswith(str(out) + "/") and not path.startswith(str(out / "sites") + "/")

    def in_round(self: Any, state: Any, rnd: int, *a: Any, **k: Any) -> Any:
        phase[0] = f"round {rnd}"
        try:
            return original_round(self, state, rnd, *a, **k)
        finally:
            phase[0] = "outside rounds"

    io_module.atomic_write = counting
    SurgicalServer._round = in_round  # type: ignore[method-assign]
    torch.set_num_threads(2)
    tmp = tempfile.mkdtemp(prefix="cxrfl-writes-")
    out = Path(tmp) / "server"
    try:
        sites = [load_site(demo_site_config(s)) for s in ("site-1", "site-2")]
        run_surgical(sites, demo_config(args.rounds, args.max_steps), out, run_id="demo")
        rounds = [r for r in read_records(out / "cxrfl" / "rounds.jsonl") if r.get("phase") == "train"]
        model = (out / "FL_global_model.pt").stat().st_size
        server = {k[len(str(out)) + 1 :]: v for k, v in written.items() if is_server(k)}
        site_bytes = sum(sum(v) for k, v in written.items() if not is_server(k))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum(sum(v) for v in server.values())
    per_round = [v for k, v in by_phase.items() if k.startswith("round ")]
    result = {
        "commit": _commit(),
        "rounds": len(rounds),
        "max_steps_per_epoch": args.max_steps,
        "model_bytes": model,
        "server_bytes": total,
        "server_bytes_by_phase": dict(by_phase),
        "model_sized_writes_per_round": [round(b / model, 2) for b in per_round],
        "site_bytes": site_bytes,
        "server_files": {k: {"writes": len(v), "bytes": sum(v)} for k, v in sorted(server.items())},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "server_files"}, indent=2))


if __name__ == "__main__":
    main()
