"""``cxrfl bench quantize``: what NVFlare's quantization filters save on the wire and cost in AUROC (issue 46).

For every format of :data:`FORMATS` and every seed, surgical aggregation's own server loop
(:func:`cxrfl.surgical.inprocess.run_surgical`) runs in this process on the ``two-hospitals`` profile
with the committed demo job's settings (:data:`cxrfl.jobs.DEMO_TRAIN`, 64 px, from scratch), until the
mean validation loss stops improving (``patience``; ``rounds`` is a guard). Each site sits behind a
:class:`QuantizedHost`: every task's payload and every answer go through the job's filters
(:func:`cxrfl.fl.quantization.round_trip`: quantize, then dequantize), so the server and the sites see
exactly what NVFlare would deliver. Measured per run: bytes per site and training round each way,
before and after quantization; the seconds quantizing and dequantizing added per round; the learning
curve; the selected round; the selected model's mean AUROC on the profile's external test set (else the
sites' test splits), compared with the unquantized run of the same seed. Each run is written to
``results.json`` as it finishes (an interrupted benchmark resumes); ``report.md`` (bytes, AUROC with
paired tests, the issue's targets, the curves compared over the rounds both runs of a seed ran) and
``learning_curves.png`` at the end.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from cxrfl.bench.inprocess import (
    load_profile,
    mean_auroc,
    num,
    open_results,
    provenance,
    run_pending,
    surgical_config,
)
from cxrfl.bench.intervals import finite_mean, holm, mean_ci
from cxrfl.bench.paired import paired
from cxrfl.bench.profiles import PROFILE_NAMES
from cxrfl.bench.report_text import local_steps, provenance_line, verdict
from cxrfl.common.config import Config
from cxrfl.data.site import SiteData
from cxrfl.fl.job_settings import QUANTIZE_TYPES
from cxrfl.fl.quantization import RoundTrip, round_trip
from cxrfl.jobs import DEMO_MODEL, DEMO_TRAIN, JOBS
from cxrfl.nn.models import ARCHS
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import TRAIN
from cxrfl.surgical.inprocess import global_model, make_hosts, nbytes, run_surgical

Log = Callable[[str], None]

FORMATS = ("none", "float16", "blockwise8", "normfloat4")
"""The default formats: unquantized (the reference), then NVFlare's 16-, 8- and 4-bit formats."""
EIGHT_BIT = "blockwise8"
TARGET_RATIO = 3.5
"""Issue 46: 8-bit updates at least this many times fewer bytes per round than float32 ..."""
TARGET_AUROC = 0.005
"""... with a mean AUROC within this of the unquantized run's (paired over seeds)."""
BYTE_KEYS = ("down_before", "down_after", "up_before", "up_after")
"""Bytes of a message the server sends (down) and of the answer (up), before and after quantization."""
_DEMO = next(j for j in JOBS if j.name == "surgical_agg").controller_args


@dataclass(frozen=True)
class QuantizeBenchSettings(Config):
    """Settings of the quantization benchmark (every run shares them; training as the committed demo job).

    Args:
        profile: benchmark profile (:func:`cxrfl.bench.profiles.prepare`).
        seeds: training seeds 0 ... seeds-1.
        formats: ``none`` and formats of :data:`cxrfl.fl.job_settings.QUANTIZE_TYPES` (``none`` always runs first:
            the reference).
        rounds: most federated rounds after the warm-up, a guard the runs should not reach (the demo
            job's 20 were reached with the validation loss still falling).
        patience: rounds without a better mean validation loss before stopping.
        image_size: model input size.
        arch: the network (:mod:`cxrfl.bench.arch`).
        steps: cap on optimiser steps per local epoch and site (None: the whole split).
        threads: torch CPU threads.
    """

    SECTION: ClassVar[str] = "bench"
    profile: str = field(default="two-hospitals", metadata={"choices": PROFILE_NAMES})
    seeds: int = field(default=3, metadata={"ge": 1})
    formats: tuple[str, ...] = FORMATS
    rounds: int = field(default=60, metadata={"ge": 1})
    patience: int = field(default=_DEMO["patience"], metadata={"ge": 1})
    image_size: int = field(default=DEMO_MODEL.image_size, metadata={"ge": 8})
    arch: str = field(default=DEMO_MODEL.arch, metadata={"choices": ARCHS})
    steps: int | None = field(default=None, metadata={"ge": 1})
    threads: int = field(default=1, metadata={"ge": 1})

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [f for f in self.formats if f not in ("none", *QUANTIZE_TYPES)]
        if unknown:
            self.fail("formats", f"has unknown format(s) {unknown}; known: {['none', *QUANTIZE_TYPES]}")
        object.__setattr__(self, "formats", ("none", *dict.fromkeys(f for f in self.formats if f != "none")))

    def server_config(self, seed: int) -> SurgicalConfig:
        """The server settings of one run (the demo job's training settings, this run's seed).

        Args:
            seed: the training seed.
        """
        train = replace(DEMO_TRAIN, max_steps_per_epoch=self.steps, seed=seed)
        return surgical_config(
            train, rounds=self.rounds, patience=self.patience, image_size=self.image_size, arch=self.arch
        )


class QuantizedHost:
    """A site host behind the job's quantization filters: what it receives is ``round_trip``'s output of the
    server's payload, and what it answers goes through ``round_trip`` again before the server sees it.
    Each task adds one row of bytes (each way, before and after) and seconds to ``rows``.

    Args:
        host: the site's host.
        site: the site's name.
        quantize: the format; None: unquantized (bytes counted, nothing changed).
        rows: where one measurement per task goes.
    """

    def __init__(self, host: Any, site: str, quantize: str | None, rows: list[dict[str, Any]]) -> None:
        self.host = host
        self.tasks = host.tasks
        self.site = site
        self.quantize = quantize
        self.rows = rows

    def _through(self, params: Mapping[str, Any]) -> tuple[RoundTrip, float]:
        """One message through the filters, and the seconds they took."""
        if self.quantize is None:
            size = nbytes(params)
            return RoundTrip(dict(params), size, size), 0.0
        start = time.perf_counter()
        out = round_trip(params, self.quantize)
        return out, time.perf_counter() - start

    def handle(self, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]) -> tuple[dict, dict]:
        down, down_seconds = self._through(params)
        out, answer = self.host.handle(task, down.params, meta)
        up, up_seconds = self._through(out)
        self.rows.append(
            {
                "site": self.site,
                "task": task,
                "phase": meta.get("phase"),
                "round": meta.get("round"),
                "down_before": down.bytes_before,
                "down_after": down.bytes_after,
                "up_before": up.bytes_before,
                "up_after": up.bytes_after,
                "seconds": down_seconds + up_seconds,
            }
        )
        return up.params, answer

    def describe(self, task: str, meta: Mapping[str, Any], answer: Mapping[str, Any]) -> str | None:
        return self.host.describe(task, meta, answer)

    def scalars(self, task: str, answer: Mapping[str, Any]) -> tuple[dict[str, float], int] | None:
        return self.host.scalars(task, answer)


def traffic(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A run's traffic: mean bytes per site and training round (each way, before and after), and the
    quantization seconds per training round (every site, both ways) and over the whole run.

    Args:
        rows: :class:`QuantizedHost`'s measurements.
    """
    train = [r for r in rows if r["task"] == TRAIN and r["phase"] == "train"]
    per_round: dict[Any, float] = {}
    for r in train:
        per_round[r["round"]] = per_round.get(r["round"], 0.0) + r["seconds"]
    return {
        "bytes": {k: finite_mean(r[k] for r in train) for k in BYTE_KEYS},
        "seconds_per_round": finite_mean(per_round.values()),
        "seconds_total": float(sum(r["seconds"] for r in rows)),
    }


def _key(fmt: str, seed: int) -> str:
    return f"{fmt}/{seed}"


def run_quantize(
    settings: QuantizeBenchSettings, out: str | Path, *, log: Log = print, data_dir: str | Path | None = None
) -> dict[str, Any]:
    """Run every (format, seed) not in ``out/results.json`` yet; write ``report.md`` and ``learning_curves.png``.

    Args:
        settings: the benchmark's settings.
        out: output folder (an interrupted benchmark resumes there).
        log: progress callback.
        data_dir: where profile data is written (default ``out/data``).

    Returns:
        the results written to ``results.json``.
    """
    out = Path(out)
    path, results = open_results(out, settings)
    data, tests = load_profile(
        settings.profile, out, image_size=settings.image_size, data_dir=data_dir, external_only=False
    )
    results.update(profile=data.profile, notes=data.notes, tests={n: t.n for n, t in tests.items()}, **provenance())
    plan = (
        (_key(fmt, seed), partial(_run_one, settings, data.sites, tests, fmt, seed, log=log))
        for seed in range(settings.seeds)
        for fmt in settings.formats
    )
    run_pending(path, results, plan, describe=_describe, log=log, prefix="cxrfl-quantize-")
    (out / "report.md").write_text(format_report(results))
    plot_curves(results, out / "learning_curves.png")
    log(f"wrote {path}, {out / 'report.md'} and {out / 'learning_curves.png'}")
    return results


def _describe(run: Mapping[str, Any]) -> str:
    return (
        f"seed {run['seed']} {run['format']}: mean AUROC {num(run['mean_auroc'])} (best round {run['best_round']} "
        f"of {run['rounds']}), up {_mb(run['bytes']['up_after'])} per site and round"
    )


def _run_one(
    settings: QuantizeBenchSettings,
    sites: Sequence[SiteData],
    tests: Mapping[str, Any],
    fmt: str,
    seed: int,
    work: Path,
    *,
    log: Log,
) -> dict[str, Any]:
    """One run of one format and seed."""
    folder = work / f"{fmt}-{seed}"
    rows: list[dict[str, Any]] = []
    quantize = None if fmt == "none" else fmt
    hosts = {s: QuantizedHost(h, s, quantize, rows) for s, h in make_hosts(sites, folder / "sites").items()}
    config = settings.server_config(seed)
    started = time.perf_counter()
    result = run_surgical(hosts, config, folder / "server", info=lambda _: None, warning=log)
    run = {
        "format": fmt,
        "seed": seed,
        "best_round": result.best_round,
        "rounds": result.rounds,
        "mean_auroc": mean_auroc(global_model(result, config.model_config), result.classes, tests),
        "val_loss": result.curve("mean_val_loss"),
        "val_auroc": result.curve("mean_val_auroc"),
        **traffic(rows),
        "messages": rows,
        "seconds": time.perf_counter() - started,
    }
    shutil.rmtree(folder, ignore_errors=True)
    return run


def summarise(results: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per format: mean bytes and their ratios to the unquantized message, seconds per round, mean AUROC with
    its interval, and the paired comparison with ``none`` over seeds (p-values Holm-adjusted over formats).

    Args:
        results: what :func:`run_quantize` writes.
    """
    runs = list(results["runs"].values())
    by_format = {f: [r for r in runs if r["format"] == f] for f in results["settings"]["formats"]}
    reference = {str(r["seed"]): r["mean_auroc"] for r in by_format.get("none", [])}
    out: dict[str, dict[str, Any]] = {}
    for fmt, mine in by_format.items():
        sizes = {k: finite_mean(r["bytes"][k] for r in mine) for k in BYTE_KEYS}
        out[fmt] = {
            "seeds": len(mine),
            "bytes": sizes,
            "ratio": {w: _ratio(sizes[f"{w}_before"], sizes[f"{w}_after"]) for w in ("down", "up")},
            "seconds_per_round": finite_mean(r["seconds_per_round"] for r in mine),
            "mean_auroc": mean_ci(r["mean_auroc"] for r in mine),
            "versus_none": None
            if fmt == "none"
            else paired(reference, {str(r["seed"]): r["mean_auroc"] for r in mine}),
        }
    compared = {f: o["versus_none"] for f, o in out.items() if o["versus_none"] is not None}
    for test in ("p", "wilcoxon_p"):
        for fmt, adjusted in holm({f: c[test] for f, c in compared.items()}).items():
            compared[fmt][f"{test}_holm"] = adjusted
    return out


def matched_rounds(results: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per quantized format, the learning curve against the unquantized run of the same seed over the rounds
    both ran, free of the stopping rule: a noisier validation loss can stop a run early (patience) and
    select a weaker model without any round being worse. Per seed, the mean over those rounds of the
    difference in mean validation AUROC and loss; then their mean over seeds with its 95 % t-interval.
    Also the rounds run and the selected round, mean over seeds.

    Args:
        results: what :func:`run_quantize` writes.
    """
    runs = list(results["runs"].values())
    reference = {r["seed"]: r for r in runs if r["format"] == "none"}
    out: dict[str, dict[str, Any]] = {}
    for fmt in results["settings"]["formats"]:
        mine = [r for r in runs if r["format"] == fmt]
        row: dict[str, Any] = {
            "rounds": finite_mean(r["rounds"] for r in mine),
            "best_round": finite_mean(r["best_round"] for r in mine),
        }
        if fmt != "none":
            pairs = [(r, reference[r["seed"]]) for r in mine if r["seed"] in reference]
            for curve in ("val_auroc", "val_loss"):
                row[curve] = mean_ci(_curve_difference(r[curve], ref[curve]) for r, ref in pairs)
        out[fmt] = row
    return out


def _curve_difference(curve: Sequence[float | None], reference: Sequence[float | None]) -> float | None:
    """Mean of ``curve - reference`` over the rounds both have a value for (None: no such round)."""
    pairs = [(a, b) for a, b in zip(curve, reference, strict=False) if a is not None and b is not None]
    return finite_mean(a - b for a, b in pairs) if pairs else None


def targets(summary: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The issue's two targets for the 8-bit format: ``target``, ``measured`` and ``met`` (None: not measured).

    Args:
        summary: :func:`summarise`'s output.
    """
    eight = summary.get(EIGHT_BIT)
    ratios = [r for r in (eight or {}).get("ratio", {}).values() if r is not None]
    bytes_met = min(ratios) >= TARGET_RATIO if len(ratios) == 2 else None
    versus = (eight or {}).get("versus_none") or {}
    diff = versus.get("difference")
    ci = versus.get("ci")
    return [
        {
            "target": f"8-bit ({EIGHT_BIT}) >= {TARGET_RATIO:g}x fewer bytes per round than float32, each way",
            "measured": " / ".join(f"{r:.2f}x" for r in ratios) + " (down / up)" if bytes_met is not None else "-",
            "met": bytes_met,
        },
        {
            "target": f"8-bit mean AUROC within {TARGET_AUROC:g} of unquantized (paired over seeds)",
            "measured": "-"
            if diff is None
            else f"{diff:+.4f}" + (f" [95% CI {ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else "") + f", n = {versus['n']}",
            "met": None if diff is None else abs(diff) <= TARGET_AUROC,
        },
    ]


def format_report(results: Mapping[str, Any]) -> str:
    """The Markdown report: bytes, time and AUROC per format, the issue's targets, the curves, provenance.

    Args:
        results: what :func:`run_quantize` writes.
    """
    s, summary = results["settings"], summarise(results)
    lines = [
        f"# Quantized updates on surgical aggregation ({results['profile']})",
        "",
        f"{s['seeds']} seed(s), {s['image_size']} px from scratch with the demo job's training settings, "
        f"{local_steps(s['steps'])}, rounds until the mean validation loss has not improved for {s['patience']} "
        f"(at most {s['rounds']}). Every task's payload and every site's answer went through the job's quantization "
        "filters (quantize, dequantize). Bytes: the arrays of one message (values and quantization state; no framing) "
        "per site and training round, mean over sites, rounds and seeds; x fewer: unquantized (float32) over "
        "quantized. Seconds: quantizing and dequantizing per training round, every site both ways, one after the other "
        "on this CPU. AUROC: the selected model's mean over the classes of the test set "
        f"({', '.join(f'{n}: {k} images' for n, k in results.get('tests', {}).items())}), with its 95 % t-interval "
        "over seeds; change: paired against the unquantized run of the same seed, with its 95 % CI and the paired "
        "t and Wilcoxon p-values, Holm-adjusted over the formats compared.",
        "",
        "| format | down per site and round | up per site and round | x fewer (down / up) | s per round | "
        "mean AUROC [95% CI] | change vs none [95% CI] | paired t p (Holm) | Wilcoxon p (Holm) | seeds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for fmt, o in summary.items():
        b, v = o["bytes"], o["versus_none"] or {}
        ratios = " / ".join("-" if r is None else f"{r:.2f}x" for r in o["ratio"].values())
        lines.append(
            f"| {fmt} | {_mb(b['down_after'])} | {_mb(b['up_after'])} | {ratios} | {_seconds(o['seconds_per_round'])} "
            f"| {_interval(o['mean_auroc']['mean'], o['mean_auroc']['ci'])} | "
            f"{'-' if fmt == 'none' else _interval(v.get('difference'), v.get('ci'), signed=True)} | "
            f"{_p(v.get('p'))} ({_p(v.get('p_holm'))}) | {_p(v.get('wilcoxon_p'))} ({_p(v.get('wilcoxon_p_holm'))}) "
            f"| {o['seeds']} |"
        )
    lines += ["", "## Targets (issue 46)", "", "| target | measured | verdict |", "| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['measured']} | {verdict(t['met'])} |" for t in targets(summary)]
    lines += [
        "",
        f"The AUROC target is met when the mean paired difference lies within +-{TARGET_AUROC:g}; its 95 % CI "
        "says whether the seeds run are enough to show it.",
    ]
    lines += _matched_table(results)
    lines += ["", "![learning curves](learning_curves.png)", "", provenance_line(results)]
    return "\n".join(lines + [""] + [f"- {n}" for n in results.get("notes", [])]) + "\n"


def _matched_table(results: Mapping[str, Any]) -> list[str]:
    """The report's section on the curves over the rounds both runs of a seed ran (:func:`matched_rounds`)."""
    lines = [
        "",
        "## The same rounds, without the stopping rule",
        "",
        "Per seed, the quantized run's mean validation AUROC and loss minus the unquantized run's, averaged over "
        "the rounds both ran (warm-up included); then the mean over seeds with its 95 % t-interval. A cost that "
        "shows in the selected model's AUROC but not here comes from where the stopping rule stopped, not from "
        "worse rounds.",
        "",
        "| format | rounds run (mean) | selected round (mean) | val AUROC change [95% CI] | val loss change [95% CI] |",
        "| --- | --- | --- | --- | --- |",
    ]
    for fmt, row in matched_rounds(results).items():
        changes = [
            "-" if fmt == "none" else _interval(row[c]["mean"], row[c]["ci"], signed=True)
            for c in ("val_auroc", "val_loss")
        ]
        lines.append(
            f"| {fmt} | {_tenths(row['rounds'])} | {_tenths(row['best_round'])} | {changes[0]} | {changes[1]} |"
        )
    return lines


def plot_curves(results: Mapping[str, Any], path: Path) -> None:
    """Every run's learning curve (the sites' mean validation loss and AUROC per round), one colour per format.

    Args:
        results: what :func:`run_quantize` writes.
        path: PNG file.
    """
    from cxrfl.bench.plots import curves_by

    s = results["settings"]
    title = f"{results['profile']}, quantized updates"
    curves_by(list(results["runs"].values()), "format", s["formats"], title, s["seeds"], path)


def _interval(mean: float | None, ci: Sequence[float] | None, signed: bool = False) -> str:
    if mean is None:
        return "n/a"
    spec = "+.4f" if signed else ".4f"
    return f"{mean:{spec}}" + (f" [{ci[0]:{spec}}, {ci[1]:{spec}}]" if ci else "")


def _seconds(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _tenths(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _ratio(before: float | None, after: float | None) -> float | None:
    return before / after if before and after else None


def _mb(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e6:.2f} MB"


def _p(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"
