"""``cxrfl bench hostile``: one hostile site among honest ones, against each robust aggregation option.

Surgical aggregation's own server loop (:func:`cxrfl.surgical.inprocess.run_surgical`) runs in this
process on a synthetic profile of ``sites`` sites (default 5, ``synth-nih``), one of which
(:class:`HostileHost`) alters every ``train`` answer (head warm-up and rounds) by an attack of
:data:`ATTACKS`: its update scaled x100, its update sign-flipped, NaN weights, or a claim of 10**12
training images. The scaled and flipped updates leave the BatchNorm running variances as trained:
altered, they turn negative and update validation rejects them (``tests/test_security_aggregation.py``),
so an attacker who wants its update counted keeps them. Every (attack, robust option, seed) runs
until the mean validation loss stops improving (``patience``); the selected global model is scored
by its mean AUROC on the profile's external test set, against the honest run (no attack, no robust
option) of the same seed.
``weighting`` is ``samples`` (a claimed count matters) except for ``median``, which is unweighted.
Runs go seed by seed through the attacks whose updates reach the model (none, scale, sign), then
through those update validation rejects whole (:data:`REJECTED`). Each run's result is written to
``results.json`` as it finishes, so an interrupted benchmark resumes where it stopped; ``report.md``
(:func:`format_report`) is written at the end.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.bench.inprocess import (
    LocalTraining,
    RunOne,
    load_profile,
    mean_auroc,
    num,
    open_results,
    provenance,
    run_pending,
    surgical_config,
)
from cxrfl.bench.intervals import detectable_difference, finite_mean, holm, paired_comparison
from cxrfl.bench.protocol import code_label
from cxrfl.bench.warmups import WarmupCache
from cxrfl.common.server import BEST_MODEL, GLOBAL_MODEL, RunStopped
from cxrfl.core.updates import RUNNING_VAR
from cxrfl.errors import ConfigError
from cxrfl.nn.models import model_from_checkpoint
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import TRAIN
from cxrfl.surgical.inprocess import InProcessResult, global_model, make_hosts, run_surgical

Log = Callable[[str], None]

ATTACKS = ("none", "scale", "sign", "nan", "count")
"""none: every site honest; scale: update x100; sign: update x-1; nan: NaN weights; count: claims 10**12 images."""
ROBUST = ("none", "median", "clip")
REJECTED = ("nan", "count")
"""Attacks update validation rejects whole (the runs train on the honest sites only), run after the others."""
SCALE = 100.0
CLAIMED = 10**12


@dataclass(frozen=True)
class HostileBenchSettings(LocalTraining):
    """Settings of the hostile-site benchmark (every run shares them; the sites' training: LocalTraining).

    Args:
        profile: a pool profile (``synth-nih`` or ``nih1000``).
        sites: number of sites (one of them hostile).
        pool: images of the synthetic pool (None: the profile's default).
        seeds: training seeds 0 ... seeds-1.
        rounds: most federated rounds after the warm-up, a guard the runs should not reach.
        patience: rounds without a better mean validation loss before stopping.
        clip_norm: the norm bound of ``clip`` (and of ``median`` groups of fewer than 3 sites); None: each
            round's lower median update norm (adaptive).
        attacks: names in :data:`ATTACKS`.
        robust: names in :data:`ROBUST`.
        threads: torch CPU threads.
    """

    profile: str = field(default="synth-nih", metadata={"choices": ("synth-nih", "nih1000")})
    sites: int = field(default=5, metadata={"ge": 3})  # one hostile among honest ones
    pool: int | None = field(default=None, metadata={"ge": 1})
    seeds: int = field(default=3, metadata={"ge": 1})
    rounds: int = field(default=40, metadata={"ge": 1})  # 15 stopped runs still learning
    patience: int = field(default=3, metadata={"ge": 1})
    clip_norm: float | None = field(default=None, metadata={"gt": 0})
    attacks: tuple[str, ...] = ATTACKS
    robust: tuple[str, ...] = ROBUST
    threads: int = field(default=1, metadata={"ge": 1})

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, name, given, known in (
            ("attacks", "attack", self.attacks, ATTACKS),
            ("robust", "robust option", self.robust, ROBUST),
        ):
            unknown = [g for g in given if g not in known]
            if unknown:
                self.fail(key, f"has unknown {name}(s) {unknown}; known: {list(known)}")

    def server_config(self, seed: int, robust: str) -> SurgicalConfig:
        """The server settings of one run."""
        train = self.train_config(seed)
        mode = None if robust == "none" else robust
        return surgical_config(
            train,
            rounds=self.rounds,
            patience=self.patience,
            image_size=self.image_size,
            arch=self.arch,
            weighting="uniform" if mode == "median" else "samples",
            robust=mode,
            clip_norm=self.clip_norm if mode else None,
        )


class HostileHost:
    """A site host whose ``train`` answers are altered by ``attack`` (see :data:`ATTACKS`).

    Args:
        host: the site's honest host.
        attack: the attack.
    """

    def __init__(self, host: Any, attack: str) -> None:
        self.host = host
        self.tasks = host.tasks
        self.attack = attack

    def handle(self, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]) -> tuple[dict, dict]:
        out, answer = self.host.handle(task, params, meta)
        if task != TRAIN:
            return out, answer
        if self.attack == "count":
            return out, {**answer, "num_samples": CLAIMED}
        return {k: self._alter(k, np.asarray(v), params.get(k)) for k, v in out.items()}, answer

    def _alter(self, key: str, value: np.ndarray, received: Any) -> np.ndarray:
        """One array of the answer under the attack (integer buffers unchanged; running variances unchanged
        by ``scale`` and ``sign``, see the module docstring)."""
        if value.dtype.kind != "f":
            return value
        if self.attack == "nan":
            return np.full_like(value, np.nan)
        if key.endswith(RUNNING_VAR):
            return value
        start = np.asarray(received, dtype=value.dtype) if received is not None else np.zeros_like(value)
        factor = SCALE if self.attack == "scale" else -1.0
        return (start + factor * (value - start)).astype(value.dtype)

    def describe(self, task: str, meta: Mapping[str, Any], answer: Mapping[str, Any]) -> str | None:
        return self.host.describe(task, meta, answer)

    def scalars(self, task: str, answer: Mapping[str, Any]) -> tuple[dict[str, float], int] | None:
        return self.host.scalars(task, answer)


def _key(attack: str, robust: str, seed: int) -> str:
    return f"{attack}/{robust}/{seed}"


def run_hostile(
    settings: HostileBenchSettings, out: str | Path, *, log: Log = print, data_dir: str | Path | None = None
) -> dict[str, Any]:
    """Run every (attack, robust option, seed) not in ``out/results.json`` yet; write ``report.md``.

    Args:
        settings: the benchmark's settings.
        out: output folder.
        log: progress callback.
        data_dir: where profile data is written (default ``out/data``).

    Returns:
        the results written to ``results.json``.
    """
    out = Path(out)
    path, results = open_results(out, settings)
    data, tests = load_profile(
        settings.profile,
        out,
        image_size=settings.image_size,
        data_dir=data_dir,
        n_per_site=settings.pool,
        n_sites=settings.sites,
    )
    results.update(profile=data.profile, hostile=data.sites[0].site, notes=data.notes, **provenance())

    warmups = WarmupCache()  # honest warm-ups shared by the runs of a seed (keyed by the seeded initial model)
    accepted = [a for a in settings.attacks if a not in REJECTED]

    def plan() -> Iterator[tuple[str, RunOne]]:
        # every seed of the attacks that reach the model first: a benchmark resumed over several sessions
        # decides the robust options before it repeats the four-site runs of the rejected attacks
        for group in (accepted, [a for a in settings.attacks if a in REJECTED]):
            for seed in range(settings.seeds):
                for attack in group:
                    for robust in settings.robust:
                        run = partial(_run_one, settings, data, tests, attack, robust, seed, warmups=warmups)
                        yield _key(attack, robust, seed), run

    run_pending(path, results, plan(), describe=_describe, log=log, prefix="cxrfl-hostile-")
    (out / "report.md").write_text(format_report(results))
    log(f"wrote {path} and {out / 'report.md'}")
    return results


def _describe(run: Mapping[str, Any]) -> str:
    return (
        f"seed {run['seed']} attack {run['attack']} robust {run['robust']}: mean AUROC {num(run['mean_auroc'])} "
        f"(best round {run['best_round']}, rejected {run['rejected']})"
    )


def _run_one(
    settings: HostileBenchSettings,
    data: Any,
    tests: Mapping[str, Any],
    attack: str,
    robust: str,
    seed: int,
    work: Path,
    *,
    warmups: WarmupCache,
) -> dict[str, Any]:
    """One run; the hostile site (the first) trains honestly and alters what it sends."""
    folder = work / f"{attack}-{robust}-{seed}"
    hosts: dict[str, Any] = make_hosts(data.sites, folder / "sites", warmups=warmups)
    bad = data.sites[0].site
    if attack != "none":
        hosts[bad] = HostileHost(hosts[bad], attack)
    config = settings.server_config(seed, robust)
    started = time.perf_counter()
    server = folder / "server"
    model: torch.nn.Module | None
    result: InProcessResult | None
    try:
        result = run_surgical(hosts, config, server, info=lambda _: None, warning=lambda _: None)
        model, classes, stopped = global_model(result, config.model_config), result.classes, None
    except RunStopped as exc:  # the attack broke the federation: the operator keeps the model selected so far
        result, stopped = None, str(exc)
        model, classes = _kept_model(server)
    records = [json.loads(line) for line in (server / "cxrfl" / "rounds.jsonl").read_text().splitlines()]
    run = {
        "attack": attack,
        "robust": robust,
        "seed": seed,
        "best_round": result.best_round if result else None,
        "rounds": result.rounds if result else max((r.get("round", 0) for r in records), default=0),
        "mean_auroc": mean_auroc(model, classes, tests),
        "rejected": sum(bad in (r.get("rejected") or {}) for r in records),
        "stopped": stopped,
        "val_loss": result.curve("mean_val_loss") if result else [r.get("mean_val_loss") for r in records],
        "seconds": time.perf_counter() - started,
    }
    shutil.rmtree(folder, ignore_errors=True)
    return run


def _kept_model(server: Path) -> tuple[torch.nn.Module | None, list[str]]:
    """The selected (else the last) global model a stopped run left, or (None, []) when it has none or its
    weights are not finite."""
    for name in (BEST_MODEL, GLOBAL_MODEL):
        if (server / name).is_file():
            try:
                model, classes, _ = model_from_checkpoint(server / name)
            except ConfigError:  # non-finite weights: no usable model
                return None, []
            return model.eval(), classes
    return None, []


def summarise(results: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per (attack, robust): mean AUROC, its change against the honest run (none/none) of each seed, rejections.

    Args:
        results: what :func:`run_hostile` writes.
    """
    runs = list(results["runs"].values())
    honest = {r["seed"]: r["mean_auroc"] for r in runs if r["attack"] == "none" and r["robust"] == "none"}
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        cell = out.setdefault(f"{r['attack']}/{r['robust']}", {"aurocs": [], "deltas": [], "rejected": 0, "stopped": 0})
        cell["aurocs"].append(r["mean_auroc"])
        cell["rejected"] += r["rejected"]
        cell["stopped"] += bool(r.get("stopped"))
        if r["mean_auroc"] is not None and honest.get(r["seed"]) is not None:
            cell["deltas"].append(r["mean_auroc"] - honest[r["seed"]])
    return {
        k: {
            "mean_auroc": finite_mean(v["aurocs"]),
            "change": finite_mean(v["deltas"]),
            "seeds": len(v["aurocs"]),
            "rejected": v["rejected"],
            "stopped": v["stopped"],
        }
        for k, v in out.items()
    }


def robust_effects(results: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each robust option against none under the same attack, paired by seed, Holm-adjusted over the family.

    Args:
        results: what :func:`run_hostile` writes.

    Returns:
        ``"attack/robust"`` -> :func:`~cxrfl.bench.intervals.paired_comparison` of the robust option's mean
        AUROC minus that of no robust option, plus ``holm_p`` (over every attack x robust option compared) and
        ``detectable`` (the smallest mean difference its seeds detect with power 0.8 at the family's first
        Holm step).
    """
    by_run = {(r["attack"], r["robust"], r["seed"]): r["mean_auroc"] for r in results["runs"].values()}
    s = results["settings"]
    out = {}
    for attack in s["attacks"]:
        base = {seed: v for (a, r, seed), v in by_run.items() if a == attack and r == "none"}
        for robust in (r for r in s["robust"] if r != "none"):
            mine = {seed: v for (a, r, seed), v in by_run.items() if a == attack and r == robust}
            out[f"{attack}/{robust}"] = paired_comparison(mine, base)
    adjusted = holm({k: c["p"] for k, c in out.items()})
    family = max(1, sum(p is not None for p in adjusted.values()))
    for key, c in out.items():
        c["holm_p"] = adjusted[key]
        c["detectable"] = detectable_difference(c["n"], c["sd"], alpha=0.05 / family)
    return out


def format_report(results: Mapping[str, Any]) -> str:
    """The Markdown report: the mean over seeds (one row per attack, one column per robust option), each
    robust option against none (paired by seed, Holm-adjusted), and every run.

    Args:
        results: what :func:`run_hostile` writes.
    """
    s, cells = results["settings"], summarise(results)
    lines = [
        f"# One hostile site among {s['sites']} ({results['profile']})",
        "",
        f"Site {results['hostile']} alters every update it sends, warm-up included (scale: x{SCALE:g}; sign: x-1; "
        "both leave the BatchNorm running variances as trained, since altered ones are rejected; nan: NaN weights; "
        f"count: claims {CLAIMED:.0e} images). {s['seeds']} seed(s), {s['image_size']} px, rounds until the mean "
        f"validation loss has not improved for {s['patience']} (at most {s['rounds']}); clip_norm "
        f"{_clip_text(s['clip_norm'])}; "
        "weighting by samples except median (unweighted). Cell: the selected global model's mean test AUROC on the "
        "external set (a class it lacks or scores with NaN: 0.5), its change against the honest run (no "
        "attack, no robust "
        "option) of the same seed, how many of the hostile site's results were rejected, and how many runs the "
        "attack stopped (every site failed: the model selected before then is scored).",
        "",
        "| attack | " + " | ".join(s["robust"]) + " |",
        "| --- |" + " --- |" * len(s["robust"]),
    ]
    for attack in s["attacks"]:
        row = []
        for robust in s["robust"]:
            c = cells.get(f"{attack}/{robust}")
            stops = f"; {c['stopped']} of {c['seeds']} stopped" if c and c["stopped"] else ""
            row.append(
                "-"
                if c is None
                else f"{num(c['mean_auroc'])} ({_signed(c['change'])}; {c['rejected']} rejected{stops})"
            )
        lines.append(f"| {attack} | " + " | ".join(row) + " |")
    lines += ["", *_effects_table(results), "", *_runs_table(results), "", _provenance(results)]
    return "\n".join(lines + [""] + [f"- {n}" for n in results.get("notes", [])]) + "\n"


def _effects_table(results: Mapping[str, Any]) -> list[str]:
    """Each robust option minus none under the same attack, paired by seed."""
    lines = [
        "Each robust option against no robust option under the same attack: the mean paired change of the mean "
        "AUROC over seeds (each seed's), its 95 % interval, the paired t-test's p and its Holm adjustment over "
        "the table's rows, and the smallest change these seeds detect with power 0.8 at Holm's first step.",
        "",
        "| attack | robust | change (per seed) | 95 % CI | p | Holm p | detectable |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, c in robust_effects(results).items():
        attack, robust = key.split("/")
        diffs = ", ".join(_signed(_diff(results, attack, robust, seed)) for seed in c["keys"])
        ci = "-" if c["ci"] is None else f"{c['ci'][0]:+.3f} to {c['ci'][1]:+.3f}"
        lines.append(
            f"| {attack} | {robust} | {_signed(c['difference'])} ({diffs}) | {ci} | {_p(c['p'])} | "
            f"{_p(c['holm_p'])} | {num(c['detectable'])} |"
        )
    return lines


def _diff(results: Mapping[str, Any], attack: str, robust: str, seed: int) -> float:
    runs = results["runs"]
    return runs[f"{attack}/{robust}/{seed}"]["mean_auroc"] - runs[f"{attack}/none/{seed}"]["mean_auroc"]


def _runs_table(results: Mapping[str, Any]) -> list[str]:
    """Every run: its mean AUROC, best and last round, rejections, time and machine."""
    lines = [
        "Every run (best round: the selected model's; -: the attack stopped the run):",
        "",
        "| attack | robust | seed | mean AUROC | best / last round | rejected | minutes | CPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(results["runs"].values(), key=lambda r: (r["seed"], r["attack"], r["robust"])):
        where = r.get("machine") or {}
        best = "-" if r.get("best_round") is None else r["best_round"]
        lines.append(
            f"| {r['attack']} | {r['robust']} | {r['seed']} | {num(r['mean_auroc'])} | {best} / {r.get('rounds')} | "
            f"{r['rejected']} | {r.get('seconds', 0) / 60:.1f} | {where.get('cpu', '?')} |"
        )
    return lines


def _provenance(results: Mapping[str, Any]) -> str:
    """The code of the runs, the machines (CPU, capability, bf16, threads) and the command."""
    codes = sorted({code_label(r.get("code") or results.get("code") or {}) for r in results["runs"].values()})
    machines = sorted(
        {
            f"{m['cpu']} ({m['cpu_capability']}, native bf16: {m['native_bf16']}), {m['torch_threads']} torch thread(s)"
            for m in (r["machine"] for r in results["runs"].values() if r.get("machine"))
        }
    )
    unknown = sum(not r.get("machine") for r in results["runs"].values())
    machines += [f"{unknown} run(s) with no machine recorded"] if unknown else []
    return f"Code {', '.join(codes)}; {'; '.join(machines)}." + (
        f" Command: `{results['command_line']}`." if results.get("command_line") else ""
    )


def _clip_text(clip_norm: float | None) -> str:
    return "adaptive (each round: the lower median update norm)" if clip_norm is None else format(clip_norm, "g")


def _signed(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.3f}"


def _p(p: float | None) -> str:
    return "-" if p is None else f"{p:.3f}"
