"""The runs of a comparison, one per (method, seed), each stored the moment it finishes.

A run is one :func:`cxrfl.surgical.inprocess.run_surgical` (the NVFlare job's own server loop, in
this process) followed by the scoring of its selected model(s) on every test set. Stored under
``<out>/runs``:

- ``protocol.json``: the settings that decide the models and the data's shape; a later
  invocation with other ones is refused (unless told to set the stored runs aside), so results of
  different protocols never mix;
- ``<entry>/seed-<k>.json``: the run's record (learning curves, selected round, per-class AUROC
  per test set and model, wall time, commit, machine);
- ``<entry>/seed-<k>.npz``: its scores per test set and model (bootstrap intervals, ROC curves;
  the statistics without intervals need only the JSON records);
- ``.work/<entry>/seed-<k>``: a run in progress (server state saved after every round): an
  interrupted run goes on from its last completed round; removed when the run is stored;
- ``.claims/<entry>/seed-<k>``: held (``flock``) by the process training that run, so that two
  invocations on the same folder (or ``--jobs`` workers) never train one run twice at once.

Runs go seed by seed (every method of seed 0, then seed 1 ...): the sites' head warm-ups are
trained once per seed and shared by its methods (:class:`cxrfl.bench.warmups.WarmupCache`).
"""

from __future__ import annotations

import fcntl
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.bench.arch import with_arch
from cxrfl.bench.evaluate import TestSet, scores_on
from cxrfl.bench.methods import Method
from cxrfl.bench.profiles import BenchData, pooled_site
from cxrfl.bench.protocol import CompareSettings, code_version, machine
from cxrfl.bench.warmups import WarmupCache
from cxrfl.common.io import json_default, read_records, write_json
from cxrfl.common.resume import RESUME_ROOT, STATE_FILE
from cxrfl.common.server import RECORDS_DIR
from cxrfl.data.site import SiteData
from cxrfl.errors import ConfigError
from cxrfl.nn.metrics import per_class_auroc, summarise_auroc
from cxrfl.nn.models import ModelConfig
from cxrfl.surgical.inprocess import InProcessResult, global_model, make_hosts, run_surgical, site_models

Log = Callable[[str], None]
RUNS_DIR = "runs"
CLAIMS_DIR = ".claims"
WORK_DIR = ".work"
PROTOCOL_FILE = "protocol.json"
RUN_ID = "run"
GLOBAL = "*"
"""Model key of a single global model (per-site models are keyed by their site)."""


@dataclass(frozen=True)
class Entry:
    """One row of the tables: a method, or for individual training a method at one site.

    Args:
        name: ``<method>`` or ``individual:<site>``.
        label: the row's label.
        method: the method.
        site: the site of an individually trained model.
    """

    name: str
    label: str
    method: Method
    site: str | None = None


def entries_for(methods: list[Method], data: BenchData) -> list[Entry]:
    """The table rows of the selected methods (individual training: one per site).

    Args:
        methods: the methods, in table order.
        data: the profile's data.
    """
    out = []
    for m in methods:
        if m.kind == "individual":
            out += [Entry(f"individual:{s.site}", f"{s.site} (individual)", m, s.site) for s in data.sites]
        else:
            out.append(Entry(m.name, m.label, m))
    return out


def safe_name(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_.+" else "_" for ch in name)


def _plain(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples as lists ...), for comparisons."""
    return json.loads(json.dumps(obj, default=json_default))


class RunStore:
    """The stored runs of one comparison (see the module docstring).

    Args:
        out: the comparison's output folder.
    """

    def __init__(self, out: Path) -> None:
        self.root = Path(out) / RUNS_DIR

    def check(self, protocol: Mapping[str, Any], data: Mapping[str, Any], *, restart: bool, log: Log) -> None:
        """Accept this protocol for the stored runs, or refuse it.

        Args:
            protocol: the settings that decide the models (:meth:`CompareSettings.protocol`).
            data: the shape of the data (sites, splits, test sets).
            restart: set stored runs of another protocol aside (``runs-set-aside-<time>``) instead of refusing.
            log: progress callback.

        Raises:
            ConfigError: stored runs of another protocol, and ``restart`` not given.
        """
        path = self.root / PROTOCOL_FILE
        now = {"protocol": _plain(protocol), "data": _plain(data)}
        if path.is_file():
            # a protocol stored before arch was recorded trained DenseNet121
            old, new = ({**p, "protocol": with_arch(p["protocol"])} for p in (json.loads(path.read_text()), now))
            differ = [
                f"{part}.{k}"
                for part in ("protocol", "data")
                for k in sorted(set(old[part]) | set(new[part]))
                if old[part].get(k) != new[part].get(k)
            ]
            if differ and not restart:
                raise ConfigError(
                    f"{self.root} holds runs of other settings ({', '.join(differ)} differ); run with the same "
                    f"settings to continue them, choose another --out, or give --restart to set them aside"
                )
            if differ:
                aside = self.root.with_name(f"{RUNS_DIR}-set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
                self.root.rename(aside)
                log(f"stored runs of other settings ({', '.join(differ)}) moved to {aside}")
        write_json(path, now)

    def record_path(self, entry: str, seed: int) -> Path:
        """The JSON record of a run."""
        return self.root / safe_name(entry) / f"seed-{seed}.json"

    def work(self, entry: str, seed: int) -> Path:
        """The folder of a run in progress."""
        return self.root / WORK_DIR / safe_name(entry) / f"seed-{seed}"

    @contextmanager
    def claim(self, entry: str, seed: int) -> Iterator[bool]:
        """Hold a run for this process while the block runs: yields False when another process
        holds it (the OS releases a claim when its process ends, however it ends).

        Args:
            entry: the entry name.
            seed: the seed.
        """
        path = self.root / CLAIMS_DIR / safe_name(entry) / f"seed-{seed}"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def set_aside_selection(self, entries: Sequence[Entry], seeds: int, selection: str, log: Log) -> None:
        """Move the stored runs selected by another rule, of the methods where the rule matters, to
        ``superseded-selection-<rule>/`` (kept for the report of how far the gaps moved); they are
        trained again. A record without ``selection`` was selected on the whole head.

        Args:
            entries: the table rows.
            seeds: seeds 0 ... seeds-1.
            selection: the rule of this comparison.
            log: progress callback.
        """
        for e in entries:
            for seed in range(seeds):
                path = self.record_path(e.name, seed)
                if not e.method.selection_matters or not path.is_file():
                    continue
                old = json.loads(path.read_text()).get("selection", "head")
                if old == selection:
                    continue
                dest = self.root / f"superseded-selection-{old}" / safe_name(e.name)
                dest.mkdir(parents=True, exist_ok=True)
                for p in (path, path.with_suffix(".npz")):
                    if p.is_file():
                        p.replace(dest / p.name)
                log(f"{e.name} seed {seed}: selected by the {old!r} rule, set aside in {dest}; trained again")

    def done(self, entry: str, seed: int) -> bool:
        """Whether the run is stored."""
        return self.record_path(entry, seed).is_file()

    def save(self, entry: str, seed: int, record: Mapping[str, Any], scores: Mapping[str, np.ndarray]) -> None:
        """Store a finished run (scores first: a record always has its scores) and drop its work folder.

        Args:
            entry: the entry name.
            seed: the seed.
            record: the run's record.
            scores: test set and model key (``<test>|<key>``) -> [n, K_test] scores.
        """
        path = self.record_path(entry, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.tmp.npz")
        np.savez_compressed(tmp, **{k: np.asarray(v, dtype=np.float32) for k, v in scores.items()})
        tmp.replace(path.with_suffix(".npz"))
        write_json(path, record)
        shutil.rmtree(self.work(entry, seed), ignore_errors=True)

    def load(self, entry: str, seed: int) -> dict[str, Any]:
        """A stored run's record."""
        return json.loads(self.record_path(entry, seed).read_text())

    def scores(self, entry: str, seed: int) -> dict[str, np.ndarray] | None:
        """A stored run's scores (None when its ``.npz`` is not there)."""
        path = self.record_path(entry, seed).with_suffix(".npz")
        if not path.is_file():
            return None
        with np.load(path) as z:
            return {k: z[k] for k in z.files}

    def tidy(self) -> None:
        """Remove the work folder once no run is in progress."""
        work = self.root / WORK_DIR
        if work.is_dir() and not any(p.is_file() for p in work.rglob("*")):
            shutil.rmtree(work, ignore_errors=True)


def sites_of(
    entry: Entry, settings: CompareSettings, data: BenchData
) -> tuple[list[SiteData], dict[str, dict[str, Any]] | None]:
    """The sites a run trains on, and per-site training settings they replace.

    Args:
        entry: the table row.
        settings: the comparison's settings.
        data: the profile's data.
    """
    kind = entry.method.kind
    if kind == "individual":
        return [next(s for s in data.sites if s.site == entry.site)], None
    if kind == "central":  # every image pooled; with a step cap, as many steps per epoch as all sites together
        pooled = pooled_site(data.sites, selection=settings.selection)
        cap = None if settings.steps is None else settings.steps * len(data.sites)
        return [pooled], ({pooled.site: {"max_steps_per_epoch": cap}} if cap else None)
    return list(data.sites), None


def trained_models(res: InProcessResult, model_config: ModelConfig) -> dict[str, tuple[torch.nn.Module, list[str]]]:
    """The selected global model (key :data:`GLOBAL`), or each site's own model (local heads or BatchNorm).

    Args:
        res: the finished run.
        model_config: network settings.
    """
    if res.site_states is not None:
        return {name: (model, res.outcome.site_classes[name]) for name, model in site_models(res, model_config).items()}
    return {GLOBAL: (global_model(res, model_config), res.classes)}


def score(
    models: Mapping[str, tuple[torch.nn.Module, list[str]]], tests: Mapping[str, TestSet]
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, dict[str, float | None]]]]:
    """Score models on the test sets they are meant for: a global model on all, a site's own model
    on its site's test split and on the external sets.

    Args:
        models: model key -> (model, its classes).
        tests: the test sets.

    Returns:
        scores by ``<test>|<key>`` ([n, K_test] float32, NaN columns for classes the model lacks),
        and per test set and key the per-class AUROC of the classes the model predicts.
    """
    scores: dict[str, np.ndarray] = {}
    aurocs: dict[str, dict[str, dict[str, float | None]]] = {}
    for key, (model, classes) in models.items():
        for name, test in tests.items():
            if key != GLOBAL and not (test.kind == "external" or name == key):
                continue
            s = scores_on(model, classes, test).astype(np.float32)
            known = [j for j, c in enumerate(test.classes) if c in classes]
            scores[f"{name}|{key}"] = s
            aurocs.setdefault(name, {})[key] = (
                per_class_auroc(test.labels[:, known], s[:, known], [test.classes[j] for j in known]) if known else {}
            )
    return scores, aurocs


def _finite(values: list[Any]) -> list[float | None]:
    return [None if v is None or not math.isfinite(v) else float(v) for v in values]


def train_run(
    entry: Entry,
    seed: int,
    *,
    settings: CompareSettings,
    data: BenchData,
    tests: Mapping[str, TestSet],
    warmups: WarmupCache,
    work: Path,
    log: Log,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Train one (method, seed) to convergence and score it; continues an interrupted run found in ``work``.

    Args:
        entry: the table row.
        seed: the training seed.
        settings: the comparison's settings.
        data: the profile's data.
        tests: the test sets.
        warmups: the seed's shared head warm-ups.
        work: the run's work folder.
        log: progress callback (the server's and the sites' lines).

    Returns:
        the run's record and its scores.
    """
    sites, overrides = sites_of(entry, settings, data)
    config = settings.run_config(entry.method, seed, len(sites))
    resumed = (work / RESUME_ROOT / RUN_ID / STATE_FILE).is_file()
    earlier = 0.0
    if resumed:  # time spent before the interruption: the server's records of the warm-up and the rounds
        earlier = sum(float(r.get("seconds") or 0.0) for r in read_records(work / RECORDS_DIR / "rounds.jsonl"))
        config = config.replace(resume_from=RUN_ID)
    else:
        shutil.rmtree(work, ignore_errors=True)
    device = settings.torch_device()
    hosts = make_hosts(sites, work / "sites", warmups=warmups, train_overrides=overrides, device=device)
    start = time.perf_counter()
    res = run_surgical(hosts, config, work, run_id=RUN_ID, info=log, warning=lambda msg: log(f"WARNING {msg}"))
    scores, aurocs = score(trained_models(res, settings.model_config()), tests)
    seconds = time.perf_counter() - start
    outcome = res.outcome
    record = {
        "entry": entry.name,
        "method": entry.method.name,
        "selection": settings.selection,
        "site": entry.site,
        "seed": seed,
        "models": {
            k: list(v)
            for k, v in (outcome.site_classes.items() if res.site_states is not None else [(GLOBAL, res.classes)])
        },
        "auroc": aurocs,
        "best_round": res.best_round,
        "rounds": res.rounds,
        "stopped_early": outcome.stopped_early,
        "curve_rounds": [p["round"] for p in outcome.curve],
        "val_loss": _finite(res.curve("mean_val_loss")),
        "val_auroc": _finite(res.curve("mean_val_auroc")),
        "site_val_loss": {s: _finite(v) for s, v in res.site_curves("site_val_loss").items()},
        "site_val_auroc": {s: _finite(v) for s, v in res.site_curves("site_val_auroc").items()},
        "seconds": earlier + seconds,
        "resumed_after_seconds": earlier if resumed else None,
        "images_per_second": res.images_per_second,
        "comm": res.comm,
        "code": code_version(),
        "machine": machine(device),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return record, scores


def run_all(
    entries: list[Entry],
    *,
    settings: CompareSettings,
    data: BenchData,
    tests: Mapping[str, TestSet],
    store: RunStore,
    log: Log,
) -> None:
    """Every (entry, seed) not stored yet, seed by seed; each stored as it finishes.

    Args:
        entries: the table rows.
        settings: the comparison's settings.
        data: the profile's data.
        tests: the test sets.
        store: where runs are stored.
        log: progress callback.
    """
    total = settings.seeds * len(entries)
    stored = sum(store.done(e.name, s) for s in range(settings.seeds) for e in entries)
    if stored:
        log(
            f"{stored} of {total} runs already stored in {store.root}"
            + (": nothing left to train" if stored == total else ": continuing with the others")
        )
    for seed in range(settings.seeds):
        todo = [e for e in entries if not store.done(e.name, seed)]
        warmups = WarmupCache()  # one head warm-up per site and seed, shared by the methods
        for entry in todo:
            tag = f"seed {seed + 1}/{settings.seeds} {entry.name}"
            record = train_and_store(
                entry,
                seed,
                settings=settings,
                data=data,
                tests=tests,
                warmups=warmups,
                store=store,
                log=lambda msg, t=tag: log(f"{t}: {msg}"),
            )
            if record is not None:
                stored += 1
                log(f"{tag}: stored ({stored}/{total}); {outcome_line(record, tests)}")
    store.tidy()


def train_and_store(
    entry: Entry,
    seed: int,
    *,
    settings: CompareSettings,
    data: BenchData,
    tests: Mapping[str, TestSet],
    warmups: WarmupCache,
    store: RunStore,
    log: Log,
) -> dict[str, Any] | None:
    """Train one (entry, seed) and store it, unless another process holds it or has stored it.

    Args:
        entry: the table row.
        seed: the training seed.
        settings: the comparison's settings.
        data: the profile's data.
        tests: the test sets.
        warmups: the seed's shared head warm-ups.
        store: where runs are stored.
        log: progress callback of this run.

    Returns:
        the stored record, or None when the run was left to another process.
    """
    with store.claim(entry.name, seed) as mine:
        if not mine or store.done(entry.name, seed):
            log("being trained by another process: left to it" if not mine else "stored by another process")
            return None
        work = store.work(entry.name, seed)
        log("continuing the interrupted run" if (work / RESUME_ROOT).is_dir() else "start")
        record, scores = train_run(
            entry, seed, settings=settings, data=data, tests=tests, warmups=warmups, work=work, log=log
        )
        store.save(entry.name, seed, record, scores)
        return record


def outcome_line(record: Mapping[str, Any], tests: Mapping[str, TestSet]) -> str:
    """How a stored run ended: its selected round, why it stopped, its time and mean test AUROCs.

    Args:
        record: the run's record.
        tests: the test sets.
    """
    means = ", ".join(f"{name} {_fmt(_mean(record, test))}" for name, test in tests.items())
    return (
        f"selected round {record['best_round']} of {record['rounds']} "
        f"({'early stop' if record['stopped_early'] else 'max_rounds reached'}), {record['seconds']:.0f}s; "
        f"mean test AUROC {means}"
    )


def _mean(record: Mapping[str, Any], test: TestSet) -> float | None:
    """Mean AUROC of a run's model on a test set (a site's own model on its split; None: no model
    for it, or one that lacks some of its classes)."""
    by_key = record["auroc"].get(test.name) or {}
    key = GLOBAL if GLOBAL in by_key else test.name if test.name in by_key else None
    if key is None:
        return None
    return summarise_auroc({c: by_key[key].get(c) for c in test.classes}, model_classes=record["models"][key])["mean"]


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"
