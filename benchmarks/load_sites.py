"""Load benchmark (issue 8): K simulated sites with small data and different label sets run
jobs/surgical_agg in the NVFlare simulator; peak server memory and round times are recorded.

    python benchmarks/load_sites.py --sites 10 --out benchmarks/results/load

Each site of the synthetic ``load-10`` profile (NIH or CheXpert format, 60 patients) also drops
two of its classes, a different pair per site, so no two sites annotate the same label set.
Peak memory is sampled every 0.2 s: the server side of the simulator (its main process and the
forked server process, which aggregates and holds the global model) and the whole process tree
(server plus site workers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from cxrfl.data.site_config import load_site_config
from cxrfl.data.site import load_site
from cxrfl.common.io import read_records
from cxrfl.synth import write_profile

REPO = Path(__file__).resolve().parents[1]


def site_data(root: Path, sites: int) -> list[str]:
    """Write the profile, give every site another label set (two classes dropped); returns the site names."""
    configs = sorted(write_profile(f"load-{sites}", root, image_size=64))
    names = []
    for k, path in enumerate(configs):
        cfg = load_site_config(path)
        classes = sorted(load_site(path).classes)
        text = path.read_text()
        drop = [classes[k % len(classes)], classes[(k + 5) % len(classes)]]
        path.write_text(text + "drop:\n" + "".join(f"  - {c}\n" for c in drop))
        names.append(cfg.site)
    return names


def label_sets(contributors: dict[str, list[str]]) -> dict[str, list[str]]:
    """site -> its classes, from a round record's class -> contributing sites."""
    out: dict[str, list[str]] = {}
    for c, sites in contributors.items():
        for s in sites:
            out.setdefault(s, []).append(c)
    return {s: sorted(c) for s, c in out.items()}


class PeakMemory(threading.Thread):
    """Sample RSS of the simulator's server side and of its whole process tree until stopped.

    The simulator's main process forks one process that runs the server (aggregation, global
    model) and starts the site workers (``simulator_worker``); the server side is every process
    of the tree that is not a site worker.
    """

    def __init__(self, pid: int, every: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.every = every
        self.server_peak = 0
        self.tree_peak = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            server = tree = 0
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    worker = "simulator_worker" in " ".join(p.cmdline())
                except psutil.Error:
                    continue
                tree += rss
                server += 0 if worker else rss
            self.server_peak = max(self.server_peak, server)
            self.tree_peak = max(self.tree_peak, tree)
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def make_job(out: Path, rounds: int, image_size: int, steps: int) -> Path:
    job = out / "surgical_agg"
    shutil.copytree(REPO / "jobs" / "surgical_agg", job)
    path = job / "app" / "config" / "config_fed_server.json"
    cfg = json.loads(path.read_text())
    args = cfg["workflows"][0]["args"]
    args.update(num_rounds=rounds, patience=rounds + 1, min_clients=2)
    args["model_config"]["image_size"] = image_size
    args["train_config"].update(warmup_epochs=1, batch_size=8, max_steps_per_epoch=steps)
    path.write_text(json.dumps(cfg, indent=2))
    return job


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2, help="local steps per round and site")
    ap.add_argument("--threads", type=int, default=2, help="simulator threads (-t)")
    ap.add_argument("--work", default="/tmp/cxrfl-load", help="scratch folder (data, job, workspace)")
    ap.add_argument("--out", default="benchmarks/results/load")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    sites = site_data(work / "data", args.sites)
    job = make_job(work, args.rounds, args.image_size, args.steps)
    ws = work / "ws"
    env = {**os.environ, "CXRFL_SITE_CONFIG_DIR": str(work / "data"), "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).with_name("nvflare")), "simulator", str(job), "-w", str(ws), "-c", ",".join(sites),
           "-t", str(args.threads)]
    start = time.perf_counter()
    load_before = os.getloadavg()
    with open(work / "simulator.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        peak = PeakMemory(proc.pid)
        peak.start()
        rc = proc.wait()
        peak.stop()
    wall = time.perf_counter() - start
    app = ws / "server" / "simulate_job" / "app_server"
    records = read_records(app / "cxrfl" / "rounds.jsonl")
    train = [r for r in records if r["phase"] == "train"]
    result = {
        "command": " ".join(["python benchmarks/load_sites.py", *sys.argv[1:]]),
        "simulator": " ".join(cmd),
        "rc": rc,
        "sites": sites,
        "distinct_label_sets": len({tuple(v) for v in label_sets(records[0]["contributors"]).values()}) if records else 0,
        "rounds_completed": [r["round"] for r in train if r["aggregated"]],
        "round_seconds": [round(r["seconds"], 1) for r in train],
        "sites_per_round": [len(r["sites_aggregated"]) for r in train],
        "classes": len(records[0]["contributors"]) if records else 0,
        "peak_server_rss_mb": round(peak.server_peak / 2**20, 1),
        "peak_tree_rss_mb": round(peak.tree_peak / 2**20, 1),
        "wall_seconds": round(wall, 1),
        "machine": f"{psutil.cpu_count()} CPU cores, {round(psutil.virtual_memory().total / 2**30)} GiB, "
                   f"Python {platform.python_version()}; load average at start {load_before[0]:.1f}",
        "settings": vars(args),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"load_{args.sites}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if rc == 0 and len(result["rounds_completed"]) == args.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
