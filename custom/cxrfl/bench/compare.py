"""``cxrfl bench compare``: every method of the papers on one profile, same splits, same code.

For each seed: one initial feature extractor and one head warm-up per site shared by all
methods (the warm-up does not depend on the method), then every method trains with the same
hyperparameters through the NVFlare job's own server loop, run in this process
(:func:`cxrfl.surgical.inprocess.run_surgical`), and its selected model(s) are scored on every
site's test split and on the external test set(s). Statistics over seeds and classes follow the
papers (:mod:`cxrfl.nn.metrics`): per-class AUROC (mean over seeds), mean +- SD over classes,
shared vs unique classes, bootstrap 95 % intervals (test images resampled, replicates pooled over
seeds), paired t-tests of per-class AUROCs against surgical aggregation with a Shapiro-Wilk test
of the differences. Writes ``results.json`` (with each run's learning curves: mean and per-site
validation loss and AUROC per round), ``report.md`` and PNG plots.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.bench.evaluate import TestSet, load_test_set, scores_on
from cxrfl.bench.methods import REFERENCE, Method, select
from cxrfl.bench.profiles import ABLATION_SHARED, ABLATION_SITES, BenchData, from_site_configs, pooled_site, prepare
from cxrfl.data.site import SiteData
from cxrfl.common.io import json_default
from cxrfl.errors import ConfigError
from cxrfl.nn.evaluation import shared_classes
from cxrfl.nn.metrics import bootstrap_aurocs, paired_ttest, per_class_auroc, percentile_ci, summarise_auroc
from cxrfl.nn.models import ModelConfig
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import WarmupCache
from cxrfl.surgical.inprocess import InProcessResult, global_model, run_surgical, site_models

Log = Callable[[str], None]


@dataclass
class CompareSettings:
    """Settings of one comparison (all methods share them).

    Args:
        profile: benchmark profile (:data:`cxrfl.bench.profiles.PROFILE_NAMES`).
        seeds: training seeds 0 ... seeds-1 (data and splits do not change with them).
        rounds: federated rounds (= local epochs of the one-site baselines) after the warm-up.
        image_size: model input size.
        data_image_size: size synthetic images are written at.
        n_per_site: images per synthetic training site.
        n_external: images of the synthetic external test site.
        steps: cap on optimiser steps per local epoch and site (None: whole split); the
            centralized baseline gets the sum over sites.
        warmup_epochs: head warm-up epochs (feature extractor frozen).
        batch_size: minibatch size.
        lr: learning rate of the rounds.
        warmup_lr: learning rate of the warm-up.
        patience: rounds without improvement of the mean validation loss before stopping.
        methods: method names (None: all).
        n_boot: bootstrap resamples per seed.
        n_sites: pool profiles: number of sites (ablation).
        n_shared: pool profiles: shared classes (ablation).
        threads: torch CPU threads (default 1: on a shared, busy CPU two OpenMP threads can be
            ten times slower than one; None: torch's default).
        augment: augment training images.
        pretrained: a local checkpoint of the feature extractor (e.g. ImageNet DenseNet121
            weights, as the papers start from); None: from scratch (no weights can be downloaded here).
        site_configs: your own training sites' config files instead of a built-in profile
            (``profile`` is then just the name in the results).
        external_configs: your own fully annotated external test sets (with ``site_configs``).
    """

    profile: str
    seeds: int = 3
    rounds: int = 8
    image_size: int = 32
    data_image_size: int = 64
    n_per_site: int | None = None
    n_external: int | None = None
    steps: int | None = 10
    warmup_epochs: int = 1
    batch_size: int = 16
    lr: float = 1e-3
    warmup_lr: float = 5e-3
    patience: int = 5
    methods: list[str] | None = None
    n_boot: int = 1000
    n_sites: int | None = None
    n_shared: int | None = None
    threads: int | None = 1
    augment: bool = True
    pretrained: str | None = None
    site_configs: list[str] | None = None
    external_configs: list[str] | None = None

    def model_config(self) -> ModelConfig:
        return ModelConfig(image_size=self.image_size, pretrained=self.pretrained)

    def train_config(self, seed: int) -> TrainConfig:
        return TrainConfig(lr=self.lr, warmup_lr=self.warmup_lr, warmup_epochs=self.warmup_epochs, local_epochs=1,
                           batch_size=self.batch_size, max_steps_per_epoch=self.steps, augment=self.augment, seed=seed)


@dataclass
class View:
    """A set of classes of one test set that the tables report.

    Args:
        name: ``<site>`` (its test split), ``<external>`` or ``<external>@<site>`` (the external
            set restricted to that site's classes).
        test: the test set name.
        classes: the classes.
        site: the training site whose model (personalized or individual) this view is about.
        kind: ``site``, ``external`` or ``external-by-site``.
        shared: for site views, the classes of this site that another site has too.
    """

    name: str
    test: str
    classes: list[str]
    site: str | None
    kind: str
    shared: list[str] | None = None


@dataclass
class Entry:
    """One row of the tables: a method (or, for individual training, a method at one site)."""

    name: str
    label: str
    method: Method
    site: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)
    # view -> per seed: (scores [n, K_view] with NaN columns where the model lacks a class, model classes)
    scores: dict[str, list[tuple[np.ndarray | None, set[str]]]] = field(default_factory=dict)
    boot: dict[str, list[np.ndarray | None]] = field(default_factory=dict)


def _views(data: BenchData, tests: dict[str, TestSet]) -> list[View]:
    site_classes = {s.site: list(s.classes) for s in data.sites}
    shared = shared_classes(site_classes)
    views = [View(s.site, s.site, tests[s.site].classes, s.site, "site", [c for c in s.classes if c in shared]) for s in data.sites]
    for name in data.external:
        t = tests[name]
        views.append(View(name, name, t.classes, None, "external"))
        if len(data.sites) > 1:
            for s in data.sites:
                views.append(View(f"{name}@{s.site}", name, [c for c in t.classes if c in s.classes], s.site, "external-by-site"))
    return views


class _Clock:
    def __init__(self, log: Log) -> None:
        self.start = time.perf_counter()
        self.log = log

    def __call__(self, msg: str) -> None:
        self.log(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - self.start:7.1f}s] {msg}")


def _print(msg: str) -> None:
    print(msg, flush=True)


def run_compare(settings: CompareSettings, out: Path, *, log: Log = _print, data_dir: Path | None = None) -> dict[str, Any]:
    """Run every selected method on the profile for every seed; write results, report and plots.

    Args:
        settings: the comparison's settings.
        out: output folder (``results.json``, ``report.md``, ``*.png``).
        log: progress callback (one line per method, seed and round, with elapsed time).
        data_dir: where profile data is written (default ``out/data``).

    Returns:
        the results dict written to ``results.json``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    clock = _Clock(log)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    methods = select(settings.methods)
    mc = settings.model_config()
    clock(f"preparing profile {settings.profile} (images {settings.data_image_size}px, model input {settings.image_size}px)")
    if settings.site_configs:
        data = from_site_configs(settings.site_configs, settings.external_configs or [], name=settings.profile)
    else:
        data = prepare(settings.profile, data_dir or out / "data", image_size=max(settings.data_image_size, settings.image_size),
                       n_per_site=settings.n_per_site, n_external=settings.n_external, n_sites=settings.n_sites,
                       n_shared=settings.n_shared)
    union = data.union
    tests = {s.site: load_test_set(s, kind="site", classes=s.classes, image_size=mc.image_size) for s in data.sites}
    for name, ext in data.external.items():
        tests[name] = load_test_set(ext, kind="external", classes=union, image_size=mc.image_size)
    views = _views(data, tests)
    clock(f"{data.profile}: {len(data.sites)} sites, test sets {', '.join(f'{k} ({t.n})' for k, t in tests.items())}; "
          f"methods {', '.join(m.name for m in methods)}; {settings.seeds} seed(s)")

    entries: dict[str, Entry] = {}
    for m in methods:
        if m.kind == "individual":
            for s in data.sites:
                entries[f"individual:{s.site}"] = Entry(f"individual:{s.site}", f"{s.site} (individual)", m, s.site)
        else:
            entries[m.name] = Entry(m.name, m.label, m)

    work_root = Path(tempfile.mkdtemp(prefix="cxrfl-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        for seed in range(settings.seeds):
            _run_seed(seed, settings, data, methods, entries, tests, views, work_root, clock)
    finally:
        shutil.rmtree(work_root, ignore_errors=True)

    results = _results(settings, data, tests, views, entries, clock)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=json_default))
    from cxrfl.bench.plots import write_plots
    from cxrfl.bench.report import format_report

    results["plots"] = write_plots(results, entries, tests, views, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=json_default))
    (out / "report.md").write_text(format_report(results))
    clock(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results['plots'])} plot(s)")
    return results


def _run_seed(seed: int, settings: CompareSettings, data: BenchData, methods: list[Method], entries: dict[str, Entry],
              tests: dict[str, TestSet], views: list[View], work_root: Path, clock: _Clock) -> None:
    """Every method for one seed; the sites' head warm-ups are trained once and shared by all of them."""
    tag = f"seed {seed + 1}/{settings.seeds}"
    warmups = WarmupCache()
    for m in methods:
        for entry, sites, overrides in _runs_of(m, settings, data, entries):
            res = run_surgical(sites, _run_config(m, settings, seed, len(sites)), work_root / m.name / entry.name,
                               warmups=warmups, train_overrides=overrides,
                               info=lambda msg, e=entry: clock(f"{tag} {e.name}: {msg}"),
                               warning=lambda msg, e=entry: clock(f"{tag} {e.name}: WARNING {msg}"))
            _score(entry, _models(res, settings.model_config()), tests, views, seed, settings.n_boot)
            entry.runs.append({"seed": seed, "best_round": res.best_round, "rounds": res.rounds,
                               "val_loss": res.curve("mean_val_loss"), "val_auroc": res.curve("mean_val_auroc"),
                               "site_val_loss": res.site_curves("site_val_loss"),
                               "site_val_auroc": res.site_curves("site_val_auroc"), "seconds": res.seconds,
                               "images_per_second": res.images_per_second, "comm": res.comm})
            means = {v.name: summarise_auroc(_aurocs(entry, v.name, seed, tests[v.test], v), model_classes=entry.scores[v.name][seed][1])["mean"]
                     for v in views if v.kind != "external-by-site"}
            clock(f"{tag} {entry.name}: best round {res.best_round}, {res.seconds:.0f}s; mean AUROC "
                  + ", ".join(f"{k} {_fmt(v)}" for k, v in means.items()))
        shutil.rmtree(work_root / m.name, ignore_errors=True)


def _runs_of(m: Method, settings: CompareSettings, data: BenchData, entries: dict[str, Entry]
             ) -> list[tuple[Entry, list[SiteData], dict[str, dict[str, int]] | None]]:
    """The runs of a method: (table entry, its sites, per-site train overrides)."""
    if m.kind == "individual":
        return [(entries[f"individual:{s.site}"], [s], None) for s in data.sites]
    if m.kind == "central":  # every image pooled; as many steps per epoch as all sites together
        pooled = pooled_site(data.sites)
        steps = None if settings.steps is None else settings.steps * len(data.sites)
        return [(entries[m.name], [pooled], {pooled.site: {"max_steps_per_epoch": steps}} if steps else None)]
    return [(entries[m.name], list(data.sites), None)]


def _run_config(m: Method, settings: CompareSettings, seed: int, n_sites: int) -> SurgicalConfig:
    """The server settings of one run (the one-site baselines: surgical head, FedAvg, every class own)."""
    federated = m.kind == "federated"
    return SurgicalConfig(
        num_rounds=settings.rounds, min_clients=n_sites, model_config=settings.model_config(),
        train_config=settings.train_config(seed), batchnorm=m.batchnorm if federated else "fedavg",
        head_mode=m.head_mode if federated else "surgical", missing=m.missing if federated else "negative",
        patience=settings.patience, min_clients_timeout=0, seed=seed, evaluate_test=False, keep_round_checkpoints=False,
    )


def _models(res: InProcessResult, model_config: ModelConfig) -> dict[str, tuple[torch.nn.Module, list[str]]]:
    """The selected model ("*": one global model) or each site's own model (local heads)."""
    if res.site_states is not None:
        return {name: (model, res.outcome.site_classes[name]) for name, model in site_models(res, model_config).items()}
    return {"*": (global_model(res, model_config), res.classes)}


def _score(entry: Entry, models: dict[str, tuple[torch.nn.Module, list[str]]], tests: dict[str, TestSet],
           views: list[View], seed: int, n_boot: int) -> None:
    """Score the entry's model(s) on every view; bootstrap once per test set and model."""
    cache: dict[tuple[str, str], tuple[np.ndarray, np.ndarray, set[str]]] = {}

    def model_key(view: View) -> str | None:
        if "*" in models:
            return "*"
        return view.site if view.site in models else None

    for view in views:
        key = model_key(view)
        test = tests[view.test]
        cols = [test.classes.index(c) for c in view.classes]
        if key is None:  # no model of this method is meant for this view (personalized FL on the full external set)
            entry.scores.setdefault(view.name, []).append((None, set()))
            entry.boot.setdefault(view.name, []).append(None)
            continue
        if (view.test, key) not in cache:
            model, classes = models[key]
            scores = scores_on(model, classes, test)
            known = ~np.isnan(scores).all(axis=0)
            boot = np.full((n_boot, len(test.classes)), np.nan)
            if known.any():
                boot[:, known] = bootstrap_aurocs(test.labels[:, known], scores[:, known], n_boot=n_boot, seed=10_000 + seed)
            cache[(view.test, key)] = (scores, boot, set(classes))
        scores, boot, classes = cache[(view.test, key)]
        entry.scores.setdefault(view.name, []).append((scores[:, cols], classes))
        entry.boot.setdefault(view.name, []).append(boot[:, cols])


def _aurocs(entry: Entry, view_name: str, seed_index: int, test: TestSet, view: View) -> dict[str, float | None]:
    scores, classes = entry.scores[view_name][seed_index]
    out: dict[str, float | None] = {c: None for c in view.classes}
    if scores is None:
        return out
    cols = [test.classes.index(c) for c in view.classes]
    labels = test.labels[:, cols]
    known = [j for j, c in enumerate(view.classes) if c in classes]
    if known:
        got = per_class_auroc(labels[:, known], scores[:, known], [view.classes[j] for j in known])
        out.update(got)
    return out


def _view_summary(entry: Entry, view: View, test: TestSet, n_seeds: int) -> dict[str, Any]:
    by_seed = [_aurocs(entry, view.name, i, test, view) for i in range(n_seeds)]
    model_classes = entry.scores[view.name][0][1]
    per_class: dict[str, float | None] = {}
    for c in view.classes:
        vals = [a[c] for a in by_seed]
        per_class[c] = None if any(v is None for v in vals) else float(np.mean(vals))
    summary = summarise_auroc(per_class, shared=view.shared, model_classes=model_classes)
    seed_means = [summarise_auroc(a, model_classes=model_classes)["mean"] for a in by_seed]
    boots = [b for b in entry.boot[view.name] if b is not None]
    ci: dict[str, list[float] | None] = {c: None for c in view.classes}
    mean_ci = None
    if boots:
        pooled = np.concatenate(boots)  # [seeds * n_boot, K_view]
        for j, c in enumerate(view.classes):
            if per_class[c] is not None:
                interval = percentile_ci(pooled[:, j])
                ci[c] = list(interval) if interval else None
        defined = [j for j, c in enumerate(view.classes) if per_class[c] is not None]
        if defined and summary["mean"] is not None:
            with warnings.catch_warnings():  # a replicate where no class holds both labels: NaN, left out
                warnings.simplefilter("ignore", RuntimeWarning)
                row_means = np.nanmean(pooled[:, defined], axis=1)
            interval = percentile_ci(row_means)
            mean_ci = list(interval) if interval else None
    summary.update(
        auroc=per_class,
        auroc_by_seed=by_seed,
        ci=ci,
        mean_ci=mean_ci,
        mean_by_seed=seed_means,
        mean_seed_sd=float(np.std(seed_means, ddof=1)) if len(seed_means) > 1 and None not in seed_means else None,
        model_knows=sorted(c for c in view.classes if c in model_classes),
    )
    return summary


def _results(settings: CompareSettings, data: BenchData, tests: dict[str, TestSet], views: list[View],
             entries: dict[str, Entry], clock: _Clock) -> dict[str, Any]:
    n_seeds = settings.seeds
    methods: dict[str, Any] = {}
    for name, entry in entries.items():
        m = entry.method
        methods[name] = {
            "label": entry.label,
            "method": m.name,
            "kind": m.kind,
            "head_mode": m.head_mode,
            "missing": m.missing,
            "batchnorm": m.batchnorm,
            "job": m.job,
            "site": entry.site,
            "single_global_model": m.single_global_model,
            "runs": entry.runs,
            "test": {v.name: _view_summary(entry, v, tests[v.test], n_seeds) for v in views},
        }
    reference = REFERENCE if REFERENCE in methods else None
    for name, res in methods.items():
        for v in views:
            cell = res["test"][v.name]
            if reference is None or name == reference:
                cell["p_vs_reference"] = None
                continue
            ref = methods[reference]["test"][v.name]["auroc"]
            cell["p_vs_reference"] = paired_ttest(cell["auroc"], ref)
    site_classes = {s.site: list(s.classes) for s in data.sites}
    results: dict[str, Any] = {
        "profile": data.profile,
        "command": " ".join(["cxrfl", *sys.argv[1:]]) if Path(sys.argv[0]).name == "cxrfl" else None,
        "settings": asdict(settings),
        "seeds": list(range(n_seeds)),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "device": "cuda" if torch.cuda.is_available() else "cpu"},
        "wall_seconds": time.perf_counter() - clock.start,
        "data": {
            "notes": data.notes,
            "sites": {s.site: {"classes": list(s.classes),
                               "n": {k: int(len(s.split_table(k))) for k in ("train", "val", "test")},
                               "config": str(data.configs.get(s.site, ""))} for s in data.sites},
            "shared_classes": shared_classes(site_classes),
            "union": data.union,
            "test_sets": {k: {"kind": t.kind, "n": t.n, "classes": t.classes, "positives": t.positives()} for k, t in tests.items()},
        },
        "views": {v.name: asdict(v) for v in views},
        "reference": reference,
        "methods": methods,
    }
    results["targets"] = evaluate_targets(results)
    return results


# ------------------------------------------------------------------------------------------ targets
def _mean(results: dict[str, Any], entry: str, view: str, part: str | None = None) -> float | None:
    cell = results["methods"].get(entry, {}).get("test", {}).get(view)
    if cell is None:
        return None
    return (cell[part] if part else cell)["mean"]


def _pair_p(results: dict[str, Any], a: str, b: str, view: str, part: str | None = None) -> float | None:
    """Paired t-test p of two entries' per-class AUROCs on a view (only its shared or unique
    classes with ``part``)."""
    ca = results["methods"].get(a, {}).get("test", {}).get(view)
    cb = results["methods"].get(b, {}).get("test", {}).get(view)
    if ca is None or cb is None:
        return None
    keep = set(ca["auroc"])
    if part is not None:
        shared = set(results["views"][view].get("shared") or [])
        keep = {c for c in keep if (c in shared) == (part == "shared")}
    return paired_ttest({c: v for c, v in ca["auroc"].items() if c in keep}, cb["auroc"])["p"]


TARGET_PROFILES = ("two-hospitals", "two-hospitals-shared")
"""The profiles the issue sets targets for (elsewhere they are shown for information only)."""


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets that apply to this profile, each with its numbers and a verdict.

    Class-heterogeneous profiles: surgical aggregation (FedAvg) on each site's test split within
    0.02 of that site's individually trained model; on the site's unique classes at least 0.05
    above vanilla FL and above FL with partial loss; on the external set above centralized,
    vanilla FL and partial loss (FedBN+ variants against surgical aggregation with FedBN+).
    Without class heterogeneity: within 0.01 of FedAvg (vanilla FL) on every test set.

    Args:
        results: the results dict (methods, views, reference).
    """
    ref = results.get("reference")
    if ref is None:
        return []
    binding = results.get("profile") in TARGET_PROFILES
    views = results["views"]
    methods = results["methods"]
    site_views = [v for v, d in views.items() if d["kind"] == "site"]
    ext_views = [v for v, d in views.items() if d["kind"] == "external"]
    targets: list[dict[str, Any]] = []

    def add(name: str, view: str, a: str, b: str, rule: str, ok: Callable[[float], bool], part: str | None = None) -> None:
        if a not in methods or b not in methods:
            return
        va, vb = _mean(results, a, view, part), _mean(results, b, view, part)
        diff = None if va is None or vb is None else va - vb
        targets.append({"target": name, "view": view, "method": a, "against": b, "part": part, "rule": rule,
                        "value": va, "other": vb, "difference": diff, "met": None if diff is None else bool(ok(diff)),
                        "p": _pair_p(results, a, b, view, part), "binding": binding})

    heterogeneous = any(len(views[v]["shared"] or []) < len(views[v]["classes"]) for v in site_views)
    if heterogeneous:
        for v in site_views:
            add("site test split: within 0.02 of the individually trained model", v, ref, f"individual:{v}",
                "SA - individual >= -0.02", lambda d: d >= -0.02)
            add("unique classes: at least 0.05 above vanilla FL", v, ref, "vanilla-fedavg", "SA - vanilla >= 0.05",
                lambda d: d >= 0.05, "unique")
            add("unique classes: above FL with partial loss", v, ref, "partial-fedavg", "SA - partial > 0",
                lambda d: d > 0, "unique")
        for v in ext_views:
            for a, b in ((ref, "centralized"), (ref, "vanilla-fedavg"), (ref, "partial-fedavg"),
                         ("surgical-fedbn+", "vanilla-fedbn+"), ("surgical-fedbn+", "partial-fedbn+")):
                add("external set: above every single-global-model alternative", v, a, b, "SA - other > 0", lambda d: d > 0)
    else:
        for v in site_views + ext_views:
            add("no class heterogeneity: matches FedAvg (vanilla FL) within 0.01", v, ref, "vanilla-fedavg",
                "|SA - FedAvg| <= 0.01", lambda d: abs(d) <= 0.01)
    return targets


# ------------------------------------------------------------------------------------------ ablations
def run_ablation(kind: str, base: CompareSettings, out: Path, *, log: Log = _print) -> dict[str, Any]:
    """The papers' ablations on a pool profile: number of sites (2 ... 10), or number of shared
    classes (0 ... 14) over 4 sites. One comparison per setting under ``out/<setting>/``, then a
    summary table and plot of the mean AUROC on the held-out fully annotated test set.

    Args:
        kind: ``sites`` or ``shared``.
        base: settings of each comparison (its ``n_sites``/``n_shared`` are replaced).
        out: output folder.
        log: progress callback.
    """
    if kind not in ("sites", "shared"):
        raise ConfigError(f"--ablation must be 'sites' or 'shared', got {kind!r}")
    if base.profile not in ("nih1000", "synth-nih"):
        raise ConfigError("ablations run on the pool profiles nih1000 and synth-nih")
    values = ABLATION_SITES if kind == "sites" else ABLATION_SHARED
    summary: dict[str, Any] = {"ablation": kind, "profile": base.profile, "values": list(values), "settings": asdict(base), "runs": {}}
    out = Path(out)
    for value in values:
        s = CompareSettings(**{**asdict(base), "n_sites": value if kind == "sites" else 4,
                               "n_shared": 4 if kind == "sites" else value})
        # personalized FL yields no global model; the papers leave it out of the ablations
        if s.methods is None:
            s.methods = [m.name for m in select(None) if not m.name.startswith("pfl")]
        log(f"ablation {kind}={value}")
        res = run_compare(s, out / f"{kind}-{value}", log=log, data_dir=out / "data")
        ext = next(v for v, d in res["views"].items() if d["kind"] == "external")
        summary["runs"][str(value)] = {
            name: {"mean": m["test"][ext]["mean"], "mean_by_seed": m["test"][ext]["mean_by_seed"],
                   "p_vs_reference": (m["test"][ext].get("p_vs_reference") or {}).get("p"), "label": m["label"]}
            for name, m in res["methods"].items()
        }
    (out / "ablation.json").write_text(json.dumps(summary, indent=1, default=json_default))
    from cxrfl.bench.plots import ablation_plot
    from cxrfl.bench.report import format_ablation

    ablation_plot(summary, out / f"ablation_{kind}.png")
    (out / "ablation.md").write_text(format_ablation(summary))
    return summary


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"
