"""``cxrfl bench compare``: every method of the papers on one profile, same splits, same code.

Every method trains with the same hyperparameters through the NVFlare job's own server loop, run in
this process (:func:`cxrfl.surgical.inprocess.run_surgical`), until its validation loss stops
improving (:mod:`cxrfl.bench.protocol`: the converged protocol by default); its selected model(s)
are scored on every site's test split and on the external test set(s). Each (method, seed) is
stored as it finishes (:mod:`cxrfl.bench.runs`), so an interrupted comparison continues where it
stopped when the same command runs again. The statistics (:mod:`cxrfl.bench.statistics`) and the
issue's targets (:mod:`cxrfl.bench.targets`) are computed from the stored runs; ``results.json``,
``report.md`` (tables shaped like the papers' Tables 1-4) and the plots go to the output folder.
:func:`run_ablation` runs the papers' ablations, one comparison per setting.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from cxrfl.bench.evaluate import TestSet, load_test_set
from cxrfl.bench.methods import ABLATION_METHODS, REFERENCE, select
from cxrfl.bench.profiles import ABLATION_SHARED, ABLATION_SITES, BenchData, from_site_configs, prepare
from cxrfl.bench.protocol import CompareSettings, code_version, command_line, machine
from cxrfl.bench.reselection import selection_deltas
from cxrfl.bench.runs import Entry, RunStore, entries_for, outcome_line, run_all, train_and_store
from cxrfl.bench.statistics import Bootstrap, View, ablation_summary, make_views, versus, view_cell
from cxrfl.bench.targets import evaluate_targets
from cxrfl.bench.warmups import WarmupCache
from cxrfl.common.io import write_json
from cxrfl.errors import ConfigError
from cxrfl.nn.evaluation import shared_classes

Log = Callable[[str], None]

ABLATION_SEEDS = 3
"""Seeds of each ablation setting by default (the comparisons themselves default to 5)."""

__all__ = [
    "ABLATION_SEEDS",
    "CompareSettings",
    "build_results",
    "data_shape",
    "default_data_dir",
    "run_ablation",
    "run_compare",
]


class _Clock:
    def __init__(self, log: Log) -> None:
        self.start = time.perf_counter()
        self.log = log

    def __call__(self, msg: str) -> None:
        self.log(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - self.start:7.1f}s] {msg}")


def _print(msg: str) -> None:
    print(msg, flush=True)


SAME_RULES = (
    "Every site labels every class of the union head, so the selection rules (each site's own classes or the whole "
    "head) count the same classes: runs selected by either stand for both and none was trained again."
)
"""The report's note where the selection rule cannot change a run."""


def default_data_dir() -> Path:
    """Where profile data is written unless told (regenerated identically when lost)."""
    return Path(tempfile.gettempdir()) / "cxrfl-bench-data"


def _data(settings: CompareSettings, data_dir: Path) -> BenchData:
    if settings.site_configs:
        return from_site_configs(
            list(settings.site_configs), list(settings.external_configs or ()), name=settings.profile
        )
    return prepare(
        settings.profile,
        data_dir,
        image_size=max(settings.data_image_size, settings.image_size),
        n_per_site=settings.n_per_site,
        n_external=settings.n_external,
        n_sites=settings.n_sites,
        n_shared=settings.n_shared,
        split=settings.split,
    )


def _tests(data: BenchData, image_size: int) -> dict[str, TestSet]:
    tests = {s.site: load_test_set(s, kind="site", classes=s.classes, image_size=image_size) for s in data.sites}
    for name, ext in data.external.items():
        tests[name] = load_test_set(ext, kind="external", classes=data.union, image_size=image_size)
    return tests


def data_shape(data: BenchData, tests: dict[str, TestSet]) -> dict[str, Any]:
    """What stored runs must share about the data: sites, their classes and split sizes, the test sets.

    Args:
        data: the profile's data.
        tests: its test sets.
    """
    return {
        "sites": {
            s.site: {"classes": list(s.classes), "n": {k: int(len(s.split_table(k))) for k in ("train", "val", "test")}}
            for s in data.sites
        },
        "shared_classes": shared_classes({s.site: list(s.classes) for s in data.sites}),
        "union": data.union,
        "test_sets": {
            k: {"kind": t.kind, "n": t.n, "classes": t.classes, "positives": t.positives()} for k, t in tests.items()
        },
    }


def run_compare(
    settings: CompareSettings,
    out: Path,
    *,
    log: Log = _print,
    data_dir: Path | None = None,
    restart: bool = False,
    report_only: bool = False,
) -> dict[str, Any]:
    """Run every selected method on the profile for every seed (those not stored yet); write
    results, report and plots.

    Args:
        settings: the comparison's settings.
        out: output folder (``results.json``, ``report.md``, ``*.png``, stored runs under ``runs/``).
        log: progress callback (one line per method, seed and round, with elapsed time).
        data_dir: where profile data is written (default :func:`default_data_dir`).
        restart: set stored runs of other settings aside instead of refusing to continue them.
        report_only: train nothing: statistics over the seeds every method has finished.

    Returns:
        the results dict written to ``results.json``.

    Raises:
        ConfigError: bad settings, or stored runs of other settings (without ``restart``).
        KeyboardInterrupt: interrupted; the finished runs stay stored.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    clock = _Clock(log)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    methods = select(settings.methods, pretrained=settings.pretrained is not None)
    clock(
        f"preparing profile {settings.profile} (images {settings.data_image_size}px, "
        f"model input {settings.image_size}px)"
    )
    data = _data(settings, Path(data_dir) if data_dir else default_data_dir())
    tests = _tests(data, settings.image_size)
    views = make_views(data, tests)
    entries = entries_for(methods, data)
    store = RunStore(out)
    store.check(settings.protocol(), data_shape(data, tests), restart=restart and not report_only, log=clock)
    if data.every_site_labels_every_class:
        data.notes.append(SAME_RULES)  # set nothing aside: a run selected by either rule stands for both
    elif not report_only:
        store.set_aside_selection(entries, settings.seeds, settings.selection, clock)
    clock(
        f"{data.profile}: {len(data.sites)} sites, test sets {', '.join(f'{k} ({t.n})' for k, t in tests.items())}; "
        f"methods {', '.join(m.name for m in methods)}; {settings.seeds} seed(s); up to {settings.max_rounds} rounds, "
        f"patience {settings.patience}; device {settings.torch_device()}, {torch.get_num_threads()} torch thread(s)"
    )
    if not report_only:
        try:
            if settings.jobs > 1:
                run_jobs(entries, settings, store, Path(data_dir) if data_dir else default_data_dir(), clock)
            else:
                run_all(entries, settings=settings, data=data, tests=tests, store=store, log=clock)
        except KeyboardInterrupt:
            clock(f"interrupted: the finished runs are stored in {store.root}; run the same command again to continue")
            raise
    seeds = [s for s in range(settings.seeds) if all(store.done(e.name, s) for e in entries)]
    if not seeds:
        raise ConfigError(f"no seed has a stored run of every method in {store.root}: nothing to report yet")
    results = build_results(settings, data, tests, views, entries, store, seeds, clock)
    from cxrfl.bench.plots import write_plots
    from cxrfl.bench.report import format_report

    results["plots"] = write_plots(results, tests, store, out)
    write_json(out / "results.json", results)
    (out / "report.md").write_text(format_report(results))
    clock(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results['plots'])} plot(s)")
    return results


def run_jobs(entries: list[Entry], settings: CompareSettings, store: RunStore, data_dir: Path, log: Log) -> None:
    """Every (entry, seed) not stored yet, ``settings.jobs`` at a time in worker processes, seed by
    seed; each stored by its worker as it finishes.

    Args:
        entries: the table rows.
        settings: the comparison's settings.
        store: where runs are stored.
        data_dir: where the profile's data was written (the workers read it there).
        log: progress callback (the workers print their own round lines).
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    todo = [(e.name, s) for s in range(settings.seeds) for e in entries if not store.done(e.name, s)]
    log(
        f"{settings.seeds * len(entries) - len(todo)} of {settings.seeds * len(entries)} runs already stored; "
        f"training {len(todo)} in {min(settings.jobs, max(len(todo), 1))} worker process(es)"
    )
    if todo:
        with ProcessPoolExecutor(
            min(settings.jobs, len(todo)), mp_context=multiprocessing.get_context("spawn")
        ) as pool:
            futures = {
                pool.submit(_job, settings, data_dir, store.root.parent, name, seed): (name, seed)
                for name, seed in todo
            }
            for n, fut in enumerate(as_completed(futures), 1):
                name, seed = futures[fut]
                log(f"seed {seed + 1}/{settings.seeds} {name}: stored ({n}/{len(todo)} of this call); {fut.result()}")
    store.tidy()


def _job(settings: CompareSettings, data_dir: Path, out: Path, entry: str, seed: int) -> str:
    """One (entry, seed) in a worker process: train, store, and say how it ended."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    data = _data(settings, data_dir)
    tests = _tests(data, settings.image_size)
    (row,) = [
        e
        for e in entries_for(select(settings.methods, pretrained=settings.pretrained is not None), data)
        if e.name == entry
    ]
    clock = _Clock(_print)
    tag = f"seed {seed + 1}/{settings.seeds} {entry}"
    record = train_and_store(
        row,
        seed,
        settings=settings,
        data=data,
        tests=tests,
        warmups=WarmupCache(),
        store=RunStore(out),
        log=lambda msg: clock(f"{tag}: {msg}"),
    )
    return "left to another process" if record is None else outcome_line(record, tests)


def _run_summary(record: dict[str, Any]) -> dict[str, Any]:
    """A stored run as results.json keeps it (its AUROCs are in the view cells)."""
    return {k: v for k, v in record.items() if k not in ("auroc", "models")}


def build_results(
    settings: CompareSettings,
    data: BenchData,
    tests: dict[str, TestSet],
    views: list[View],
    entries: list[Entry],
    store: RunStore,
    seeds: list[int],
    clock: Log,
) -> dict[str, Any]:
    """The results dict of a comparison from its stored runs.

    Args:
        settings: the comparison's settings.
        data: the profile's data.
        tests: the test sets.
        views: the views.
        entries: the table rows.
        store: the stored runs.
        seeds: the seeds to report (every entry has a run for each).
        clock: progress callback.
    """
    clock(f"statistics over seeds {seeds} ({settings.n_boot} bootstrap resamples per seed)")
    boot = Bootstrap(tests, store.scores, settings.n_boot)
    records = {e.name: [store.load(e.name, s) for s in seeds] for e in entries}
    methods: dict[str, Any] = {}
    for e in entries:
        m = e.method
        methods[e.name] = {
            "label": e.label,
            "method": m.name,
            "kind": m.kind,
            "head_mode": m.head_mode,
            "missing": m.missing,
            "batchnorm": m.batchnorm,
            "job": m.job,
            "site": e.site,
            "single_global_model": m.single_global_model,
            "runs": [_run_summary(r) for r in records[e.name]],
            "test": {v.name: view_cell(e.name, records[e.name], v, boot) for v in views},
        }
    reference = REFERENCE if REFERENCE in methods else None
    for name, res in methods.items():
        for v in views:
            cell = res["test"][v.name]
            cell["vs_reference"] = (
                None if reference in (None, name) else versus(cell, methods[reference]["test"][v.name], v)
            )
    runs = [r for rs in records.values() for r in rs]
    results: dict[str, Any] = {
        "selection_deltas": selection_deltas(store, entries, seeds),
        "profile": data.profile,
        "command": command_line(),
        "settings": settings.to_dict(),
        "seeds": seeds,
        # one machine whatever its load: each run keeps its own load average
        "machines": _unique([{k: v for k, v in r["machine"].items() if k != "load_average"} for r in runs]),
        "commits": _unique([r["code"] for r in runs]),
        "reported_by": {"code": code_version(), "machine": machine(settings.torch_device())},
        "run_seconds": sum(float(r["seconds"]) for r in runs),
        "data": {
            "notes": data.notes,
            **data_shape(data, tests),
            "configs": {k: str(v) for k, v in data.configs.items()},
        },
        "views": {v.name: asdict(v) for v in views},
        "reference": reference,
        "methods": methods,
    }
    results["targets"] = evaluate_targets(results)
    return results


def _unique(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Distinct dicts, with how many runs each was seen in."""
    seen: dict[str, dict[str, Any]] = {}
    for item in items:
        key = json.dumps(item, sort_keys=True, default=str)
        seen.setdefault(key, {**item, "runs": 0})["runs"] += 1
    return list(seen.values())


def run_ablation(
    kind: str,
    base: CompareSettings,
    out: Path,
    *,
    values: tuple[int, ...] | None = None,
    log: Log = _print,
    data_dir: Path | None = None,
    restart: bool = False,
    report_only: bool = False,
) -> dict[str, Any]:
    """The papers' ablations on a pool profile: the number of sites (each sharing 4 classes), or the
    number of shared classes over 4 sites. One comparison per setting under ``out/<kind>-<value>/``
    (each resumable), then ``ablation.json``, ``ablation.md`` and a plot of the mean AUROC on the
    held-out fully annotated test set.

    Args:
        kind: ``sites`` or ``shared``.
        base: settings of each comparison (``n_sites``/``n_shared`` are set per value; methods
            default to :data:`cxrfl.bench.methods.ABLATION_METHODS`).
        out: output folder.
        values: the settings (default :data:`cxrfl.bench.profiles.ABLATION_SITES` or ``ABLATION_SHARED``).
        log: progress callback.
        data_dir: where profile data is written.
        restart: set stored runs of other settings aside.
        report_only: train nothing (see :func:`run_compare`).
    """
    if kind not in ("sites", "shared"):
        raise ConfigError(f"--ablation must be 'sites' or 'shared', got {kind!r}")
    if base.profile not in ("nih1000", "synth-nih"):
        raise ConfigError("ablations run on the pool profiles nih1000 and synth-nih")
    values = tuple(values or (ABLATION_SITES if kind == "sites" else ABLATION_SHARED))
    base = base.replace(methods=list(base.methods or ABLATION_METHODS))
    out = Path(out)
    runs = {}
    for value in values:
        s = base.replace(n_sites=value if kind == "sites" else 4, n_shared=4 if kind == "sites" else value)
        log(f"ablation {kind}={value}")
        runs[str(value)] = run_compare(
            s, out / f"{kind}-{value}", log=log, data_dir=data_dir, restart=restart, report_only=report_only
        )
    summary = {**ablation_summary(kind, runs, REFERENCE), "profile": base.profile, "settings": base.to_dict()}
    write_json(out / "ablation.json", summary)
    from cxrfl.bench.ablation_report import format_ablation
    from cxrfl.bench.plots import ablation_plot

    ablation_plot(summary, out / f"ablation_{kind}.png")
    (out / "ablation.md").write_text(format_ablation(summary))
    return summary
