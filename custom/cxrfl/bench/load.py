"""``cxrfl bench load``: K simulated sites with small data and different label sets run the
``surgical_agg`` job in the NVFlare simulator; peak server memory and round times are recorded.

Each site of the synthetic ``load-K`` profile (NIH or CheXpert format, 60 patients) also drops
two of its classes, a different pair per site, so no two sites annotate the same label set.
Peak memory is sampled every 0.2 s: the server side of the simulator (its main process and the
forked server process, which aggregates and holds the global model) and the whole process tree
(server plus site workers); for the server side also its PSS (pages shared by the forked pair
counted once) and, per process and per phase of the run, RSS, PSS and USS
(:class:`PeakMemory`). Results: ``OUT/load_<K>.json``. ``--harness`` measures the server loop
alone instead (:mod:`cxrfl.bench.server_memory`).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from cxrfl.common.config import Config
from cxrfl.common.io import read_records, write_json

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSettings(Config):
    """What the load benchmark runs.

    Args:
        sites: simulated sites (a ``load-<sites>`` profile must exist).
        rounds: federated rounds.
        image_size: model input size.
        steps: local steps per round and site.
        threads: simulator threads (``-t``).
    """

    SECTION: ClassVar[str] = "bench"
    sites: int = field(default=10, metadata={"ge": 2})
    rounds: int = field(default=3, metadata={"ge": 1})
    image_size: int = field(default=32, metadata={"ge": 32})
    steps: int = field(default=2, metadata={"ge": 1})
    threads: int = field(default=2, metadata={"ge": 1})


def site_data(root: Path, sites: int) -> list[str]:
    """Write the ``load-<sites>`` profile, give every site another label set (two classes dropped).

    Args:
        root: where the sites are written.
        sites: how many.

    Returns:
        the site names.
    """
    from cxrfl.data.site import load_site
    from cxrfl.data.site_config import load_site_config
    from cxrfl.synth import write_profile

    configs = sorted(write_profile(f"load-{sites}", root, image_size=64))
    names = []
    for k, path in enumerate(configs):
        cfg = load_site_config(path)
        classes = sorted(load_site(path).classes)
        drop = [classes[k % len(classes)], classes[(k + 5) % len(classes)]]
        path.write_text(path.read_text() + "drop:\n" + "".join(f"  - {c}\n" for c in drop))
        names.append(cfg.site)
    return names


def label_sets(contributors: dict[str, list[str]]) -> dict[str, list[str]]:
    """site -> its classes, from a round record's class -> contributing sites.

    Args:
        contributors: class -> the sites that sent its head row.
    """
    out: dict[str, list[str]] = {}
    for c, sites in contributors.items():
        for s in sites:
            out.setdefault(s, []).append(c)
    return {s: sorted(c) for s, c in out.items()}


class PeakMemory(threading.Thread):
    """Sample the memory of the simulator's server side and of its whole process tree until stopped.

    The simulator's main process forks one process that runs the server (aggregation, global
    model) and starts the site workers (``simulator_worker``); the server side is every process
    of the tree that is not a site worker. A forked process shares pages with its parent, so
    their summed RSS counts those pages twice: the proportional set size (PSS, shared pages split
    between their sharers) is the honest sum, and each process's unique set size (USS) what it
    alone holds. Peaks are also kept per phase, named after the last record in ``rounds.jsonl``
    (``warm-up``: before the first one; ``after train 1``: while round 2 runs, ...).

    Args:
        pid: the simulator's process id.
        every: seconds between samples.
        records: the server's ``rounds.jsonl`` (None: no phases).
    """

    def __init__(self, pid: int, every: float = 0.2, records: Path | None = None) -> None:
        import psutil

        super().__init__(daemon=True)
        self.psutil = psutil
        self.proc = psutil.Process(pid)
        self.every = every
        self.records = records
        self.server_peak = self.server_pss_peak = self.tree_peak = 0
        self.processes: dict[int, dict[str, Any]] = {}
        self.phases: dict[str, dict[str, int]] = {}
        self._halt = threading.Event()

    def _phase(self) -> str:
        try:
            lines = self.records.read_text().splitlines() if self.records else []
            last = json.loads(lines[-1]) if lines else None
        except (OSError, ValueError):
            return "warm-up"
        return "warm-up" if last is None else f"after {last.get('phase')} {last.get('round')}"

    def _sample(self, p: Any) -> tuple[str, Any] | None:
        try:
            cmd = " ".join(p.cmdline())
            return (cmd, p.memory_info()) if "simulator_worker" in cmd else (cmd, p.memory_full_info())
        except self.psutil.Error:
            return None

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
            except self.psutil.Error:
                break
            server = pss = tree = 0
            for p in procs:
                sample = self._sample(p)
                if sample is None:
                    continue
                cmd, mem = sample
                tree += mem.rss
                if "simulator_worker" in cmd:
                    continue
                server, pss = server + mem.rss, pss + mem.pss
                peak = self.processes.setdefault(
                    p.pid,
                    {
                        "role": "main" if p.pid == self.proc.pid else "forked",
                        "cmd": cmd[-120:],
                        "rss": 0,
                        "pss": 0,
                        "uss": 0,
                    },
                )
                for key in ("rss", "pss", "uss"):
                    peak[key] = max(peak[key], getattr(mem, key))
            phase = self.phases.setdefault(self._phase(), {"rss": 0, "pss": 0})
            phase["rss"], phase["pss"] = max(phase["rss"], server), max(phase["pss"], pss)
            self.server_peak, self.server_pss_peak = max(self.server_peak, server), max(self.server_pss_peak, pss)
            self.tree_peak = max(self.tree_peak, tree)
            self._halt.wait(self.every)

    def stop(self) -> None:
        """Stop sampling (the peaks stay)."""
        self._halt.set()
        self.join()

    def breakdown(self) -> dict[str, Any]:
        """Peaks in MB: per server-side process (RSS, PSS, USS) and per phase (summed RSS and PSS)."""
        mb = lambda b: round(b / 2**20, 1)  # noqa: E731
        return {
            "processes": [
                {
                    "pid": pid,
                    "role": p["role"],
                    "cmd": p["cmd"],
                    **{f"peak_{k}_mb": mb(p[k]) for k in ("rss", "pss", "uss")},
                }
                for pid, p in sorted(self.processes.items())
                if p["rss"]
            ],
            "phases": {
                name: {"peak_rss_mb": mb(v["rss"]), "peak_pss_mb": mb(v["pss"])} for name, v in self.phases.items()
            },
        }


def make_job(out: Path, s: LoadSettings) -> Path:
    """The ``surgical_agg`` job with the benchmark's rounds, image size and steps.

    Args:
        out: parent folder of the job folder.
        s: the settings.
    """
    from cxrfl.deploy.jobs import build_job

    return build_job(
        "surgical_agg",
        out,
        mode="readme",
        overrides={
            "num_rounds": s.rounds,
            "patience": s.rounds + 1,
            "min_clients": 2,
            "model_config.image_size": s.image_size,
            "train_config.warmup_epochs": 1,
            "train_config.batch_size": 8,
            "train_config.max_steps_per_epoch": s.steps,
        },
    )


def records_path(work: Path) -> Path:
    """The server's round records of the simulator run under ``work``."""
    return work / "ws" / "server" / "simulate_job" / "app_server" / "cxrfl" / "rounds.jsonl"


def _simulate(job: Path, sites: list[str], work: Path, s: LoadSettings) -> tuple[list[str], int, PeakMemory, float]:
    env = {**os.environ, "CXRFL_SITE_CONFIG_DIR": str(work / "data"), "OMP_NUM_THREADS": "1"}
    cmd = [
        str(Path(sys.executable).with_name("nvflare")),
        "simulator",
        str(job),
        "-w",
        str(work / "ws"),
        "-c",
        ",".join(sites),
        "-t",
        str(s.threads),
    ]
    start = time.perf_counter()
    with open(work / "simulator.log", "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        peak = PeakMemory(proc.pid, records=records_path(work))
        peak.start()
        rc = proc.wait()
        peak.stop()
    return cmd, rc, peak, time.perf_counter() - start


def run_load(
    s: LoadSettings,
    out: str | Path,
    work: str | Path,
    *,
    command: str | None = None,
    log: Callable[[str], None] = logger.info,
) -> dict[str, Any]:
    """Run the load benchmark; write ``OUT/load_<sites>.json`` (and return it).

    Args:
        s: the settings.
        out: output folder.
        work: scratch folder (data, job, workspace; emptied first).
        command: the command line, for the results.
        log: progress lines.
    """
    import psutil

    work = Path(work)
    shutil.rmtree(work, ignore_errors=True)
    sites = site_data(work / "data", s.sites)
    job = make_job(work, s)
    load_before = os.getloadavg()
    log(f"nvflare simulator {job.name}: {len(sites)} sites, {s.rounds} rounds (log: {work / 'simulator.log'})")
    cmd, rc, peak, wall = _simulate(job, sites, work, s)
    records = read_records(records_path(work))
    train = [r for r in records if r["phase"] == "train"]
    result = {
        "command": command or f"cxrfl bench load --sites {s.sites} --out {out}",
        "simulator": " ".join(cmd),
        "rc": rc,
        "sites": sites,
        "distinct_label_sets": len({tuple(v) for v in label_sets(records[0]["contributors"]).values()})
        if records
        else 0,
        "rounds_completed": [r["round"] for r in train if r["aggregated"]],
        "round_seconds": [round(r["seconds"], 1) for r in train],
        "sites_per_round": [len(r["sites_aggregated"]) for r in train],
        "classes": len(records[0]["contributors"]) if records else 0,
        "peak_server_rss_mb": round(peak.server_peak / 2**20, 1),
        "peak_server_pss_mb": round(peak.server_pss_peak / 2**20, 1),
        "peak_tree_rss_mb": round(peak.tree_peak / 2**20, 1),
        "server_memory": peak.breakdown(),
        "wall_seconds": round(wall, 1),
        "machine": f"{psutil.cpu_count()} CPU cores, {round(psutil.virtual_memory().total / 2**30)} GiB, "
        f"Python {platform.python_version()}; load average at start {load_before[0]:.1f}",
        "settings": {**s.to_dict(), "work": str(work), "out": str(out)},
    }
    path = write_json(Path(out) / f"load_{s.sites}.json", result)
    log(f"wrote {path}")
    return result
