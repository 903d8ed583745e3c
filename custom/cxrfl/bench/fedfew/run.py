"""Run the FedFew benchmark: every (method, seed) once, each result kept as it finishes.

``OUT/runs/seed<k>/<method>.json`` holds one finished (method, seed); ``OUT/runs/settings.json``
the settings they ran with. A later call with the same settings runs only what is missing (an
interrupted benchmark goes on, or methods are added to a finished one: the methods to run and the
number of parallel seeds do not count); other settings are refused unless ``resume=False``, which
starts over. After every seed (and every method when seeds run one at a time) ``OUT/results.json``
(settings, machine, every stored run of these seeds, also of methods this call did not name, the
summary and targets), ``OUT/report.md`` and the plots are written again from the finished runs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cxrfl.bench.fedfew.data import prepare_data, site_counts
from cxrfl.bench.fedfew.plots import write_plots
from cxrfl.bench.fedfew.report import format_markdown, summarise
from cxrfl.bench.fedfew.seed import RUN_ORDER, SeedRun
from cxrfl.bench.fedfew.settings import METHODS, FedFewBenchSettings, identity
from cxrfl.bench.protocol import code_version, command_line, machine
from cxrfl.common.io import write_json
from cxrfl.errors import ConfigError

logger = logging.getLogger(__name__)

RESULTS, REPORT, RUNS = "results.json", "report.md", "runs"


class FedFewRunStore:
    """The finished (method, seed) results of an output folder.

    Args:
        out: the output folder.
    """

    def __init__(self, out: Path) -> None:
        self.root = Path(out) / RUNS

    def open(self, settings: FedFewBenchSettings, resume: bool) -> None:
        """Keep the runs of these settings; refuse others (``resume``) or remove them (not ``resume``).

        Args:
            settings: this call's settings.
            resume: keep finished runs.
        """
        marker = self.root / "settings.json"
        wanted = settings.identity()
        if marker.is_file() and resume and identity(json.loads(marker.read_text())) != wanted:
            raise ConfigError(
                f"{self.root} holds runs of other settings; use another --out, the same settings, "
                "or --no-resume to start over"
            )
        if not resume:
            shutil.rmtree(self.root, ignore_errors=True)
        write_json(marker, wanted)

    def path(self, seed: int, method: str) -> Path:
        """The file of one (method, seed).

        Args:
            seed: the seed.
            method: the method.
        """
        return self.root / f"seed{seed}" / f"{method}.json"

    def save(self, seed: int, method: str, result: dict[str, Any]) -> None:
        """Keep one finished (method, seed) (atomically).

        Args:
            seed: the seed.
            method: the method (``data``: the seed's site counts).
            result: its results.
        """
        write_json(self.path(seed, method), result)

    def runs(self, seeds: Sequence[int], methods: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
        """method -> seed (as text) -> result, of the finished ones among ``seeds`` x ``methods``.

        Args:
            seeds: the seeds.
            methods: the methods.
        """
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for m in methods:
            for s in seeds:
                if self.path(s, m).is_file():
                    out.setdefault(m, {})[str(s)] = json.loads(self.path(s, m).read_text())
        return out


def run_seed(
    settings: FedFewBenchSettings,
    seed: int,
    methods: Sequence[str],
    data_root: Path,
    work: Path,
    out: Path,
    log: Callable[[str], None],
    done: Callable[[], object] = lambda: None,
) -> int:
    """Run some methods of one seed, keeping each result as it finishes.

    Args:
        settings: the benchmark settings.
        seed: the seed.
        methods: the methods still to run.
        data_root: where the seeds' synthetic data is written.
        work: where stage files and models go.
        out: the output folder (its run store).
        log: progress lines.
        done: called after each finished method.

    Returns:
        the seed.
    """
    torch.set_num_threads(settings.threads)
    start = time.perf_counter()
    store = FedFewRunStore(out)
    data = prepare_data(settings, data_root / f"seed{seed}", seed)
    counts = site_counts(data)
    store.save(seed, "data", counts)
    log(
        f"seed {seed}: data ready ({time.perf_counter() - start:.0f}s): "
        + ", ".join(f"{s} {c['labelled']}/{c['train']} labelled" for s, c in counts.items())
    )
    runner = SeedRun(settings, seed, data, work, log)
    code = code_version()  # each run names its code: a benchmark's runs may span commits
    for method in methods:
        result = {**runner.run(method), "device": settings.device, "code": code}
        store.save(seed, method, result)
        log(
            f"seed {seed} {method}: mean UC F1 {result['mean_uc_f1']:.3f}"
            + (f", mean CC AUROC {result['mean_cc_auroc']:.3f}" if result.get("mean_cc_auroc") is not None else "")
            + f" ({result['seconds']:.0f}s)"
        )
        done()
    return seed


def _run_seed_in_worker(
    settings: FedFewBenchSettings, seed: int, methods: Sequence[str], data_root: Path, work: Path, out: Path
) -> int:
    """:func:`run_seed` in a worker process; its lines go to that process's stdout, tagged with the seed."""
    return run_seed(settings, seed, methods, data_root, work, out, lambda m: print(f"[seed {seed}] {m}", flush=True))


def write_results(
    out: Path, base: dict[str, Any], runs: dict[str, dict[str, dict[str, Any]]], complete: bool, wall: float
) -> dict[str, Any]:
    """``results.json``, ``report.md`` and the plots, from the finished runs.

    Args:
        out: the output folder.
        base: settings, seeds, machine, command, earlier wall time and the seeds' site counts.
        runs: method -> seed -> result.
        complete: every (method, seed) has finished.
        wall: seconds this call has run.
    """
    seeds_done = sorted({int(s) for by_seed in runs.values() for s in by_seed})
    result = {
        **base,
        "runs": runs,
        "seeds_done": seeds_done,
        "complete": complete,
        "wall_seconds": round(wall, 1),
        "wall_seconds_total": round(base.get("wall_seconds_before", 0.0) + wall, 1),
    }
    result.pop("wall_seconds_before", None)
    if runs:
        result["summary"] = summarise(runs)
        result["plots"] = write_plots(result, out)
    write_json(out / RESULTS, result)
    (out / REPORT).write_text(format_markdown(result))
    return result


def run_fedfew_benchmark(
    out: str | Path,
    seeds: int | Sequence[int] = 3,
    *,
    settings: FedFewBenchSettings | None = None,
    data_root: str | Path | None = None,
    work: str | Path | None = None,
    log: Callable[[str], None] = logger.info,
    resume: bool = True,
    command: str | None = None,
    only: Sequence[int] | None = None,
    report_only: bool = False,
) -> dict[str, Any]:
    """Run the FedFew benchmark; write ``OUT/results.json``, ``OUT/report.md`` and the plots (and return the results).

    Args:
        out: output folder.
        seeds: number of seeds (0, 1, ...) or the seeds themselves.
        settings: everything else (default: :class:`FedFewBenchSettings`).
        data_root: where the synthetic data is written (default ``$CXRFL_DEMO_DIR`` or
            ``~/.cache/cxrfl``, then ``fedfew-bench``); reused when already there.
        work: where the runs' stage files and models go (default: ``DATA_ROOT/runs``).
        log: progress lines.
        resume: go on with the finished (method, seed) runs in ``OUT`` (same settings only).
        command: the command line, for the report.
        only: run only these of ``seeds`` now (default: all); the results still cover every seed's finished
            runs, and say ``complete`` only when no (method, seed) is missing.
        report_only: train nothing: results, report and plots again from the stored runs (e.g. after a run
            was stopped between two seeds' writes).

    Raises:
        ConfigError: ``only`` names a seed that is not among ``seeds``, or ``report_only`` without ``resume``.
    """
    settings = settings or FedFewBenchSettings()
    seeds = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if report_only and not resume:
        raise ConfigError("--report-only reads the stored runs; it cannot start over (--no-resume)")
    if only is not None and set(only) - set(seeds):
        raise ConfigError(f"--only-seeds {sorted(set(only) - set(seeds))} not among the seeds {seeds}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data_root = Path(
        data_root or Path(os.environ.get("CXRFL_DEMO_DIR") or Path.home() / ".cache" / "cxrfl") / "fedfew-bench"
    )
    work = Path(work) if work else data_root / "runs"
    store = FedFewRunStore(out)
    store.open(settings, resume)
    earlier = json.loads((out / RESULTS).read_text()) if resume and (out / RESULTS).is_file() else {}
    base = {
        "benchmark": "fedfew",
        "command": command or command_line() or f"cxrfl bench fedfew --seeds {len(seeds)} --out {out}",
        "settings": settings.to_dict(),
        "seeds": seeds,
        "machine": machine(torch.device(settings.device)),
        "code": code_version(),
        "wall_seconds_before": float(earlier.get("wall_seconds_total", 0.0)) if earlier.get("runs") else 0.0,
    }
    methods = [m for m in RUN_ORDER if m in settings.runs]
    finished = store.runs(seeds, methods)
    missing = {s: [m for m in methods if str(s) not in finished.get(m, {})] for s in seeds}
    now = set() if report_only else set(seeds if only is None else only)
    todo = {s: ms for s, ms in missing.items() if ms and s in now}
    left = any(ms for s, ms in missing.items() if s not in now)  # seeds with runs missing, not run now
    if finished:
        log(f"resuming: {sum(len(v) for v in finished.values())} finished (method, seed) run(s) in {store.root}")
    start = time.perf_counter()

    def write(complete: bool = False) -> dict[str, Any]:
        base["data"] = store.runs(seeds, ["data"]).get("data", {})
        return write_results(out, base, store.runs(seeds, METHODS), complete, time.perf_counter() - start)

    torch.set_num_threads(settings.threads)
    if settings.jobs > 1 and len(todo) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        for seed in todo:  # write the data first, one seed at a time (the writer forks its own workers)
            prepare_data(settings, data_root / f"seed{seed}", seed)
        with ProcessPoolExecutor(
            min(settings.jobs, len(todo)), mp_context=multiprocessing.get_context("spawn")
        ) as pool:
            futures = [
                pool.submit(_run_seed_in_worker, settings, s, ms, data_root, work, out) for s, ms in todo.items()
            ]
            for fut in as_completed(futures):
                log(f"seed {fut.result()} finished")
                write()
    else:
        for seed, ms in todo.items():
            run_seed(settings, seed, ms, data_root, work, out, log, done=write)
    result = write(complete=not left)
    log(f"wrote {out / RESULTS}, {out / REPORT} and {len(result.get('plots', []))} plot(s)")
    return result
