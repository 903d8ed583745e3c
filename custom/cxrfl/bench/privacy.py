"""``cxrfl bench privacy``: what NVFlare's privacy filters do to surgical aggregation, measured.

For every seed and privacy option (:data:`OPTIONS`: off, cxrfl's defaults, NVFlare's defaults and
settings around them) the NVFlare job's own server loop runs in this process
(:func:`cxrfl.surgical.inprocess.run_surgical`) on the same data with the same seed; each site's
``train`` answer (head warm-up and rounds) goes through the filter exactly as the job's
:class:`cxrfl.fl.privacy.UpdatePrivacy` sends it (:func:`cxrfl.fl.privacy.privatize_update`:
NVFlare's filter on the weight difference, one filter per site and run). Measured per site and
round, per part (feature extractor weights, BatchNorm statistics, head rows;
:func:`cxrfl.common.privacy.fidelity`): cosine similarity and relative norm of the sent vs the
true update and the share of changed entries sent; the epsilon NVFlare's SVT accountant spends
per round and over the run; and the selected model's mean AUROC on the external test set against
the unfiltered run, and every run's learning curve. The sites' warm-ups are trained once per
seed and shared by the options (the filter acts on what leaves the site). Writes ``results.json``,
``report.md`` and ``learning_curves.png``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.bench.evaluate import scores_on
from cxrfl.bench.inprocess import LocalTraining, load_profile, num, surgical_config
from cxrfl.bench.intervals import finite_mean
from cxrfl.bench.profiles import PROFILE_NAMES
from cxrfl.bench.protocol import code_version, machine
from cxrfl.bench.warmups import WarmupCache
from cxrfl.common.io import json_default
from cxrfl.common.privacy import NVFLARE_DEFAULTS, PARTS, PRIVACY_DEFAULTS, check_privacy, fidelity
from cxrfl.data.site import SiteData
from cxrfl.errors import ConfigError
from cxrfl.nn.metrics import per_class_auroc, summarise_auroc
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import TRAIN
from cxrfl.surgical.inprocess import global_model, make_hosts, run_surgical
from cxrfl.surgical.learner import SiteLearner

Log = Callable[[str], None]


def _option(method: str, args: Mapping[str, Any]) -> dict[str, Any]:
    return {"method": method, "args": dict(args)}


OPTIONS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "percentile": _option("percentile", PRIVACY_DEFAULTS["percentile"]),
    "percentile-gamma-0.5": _option("percentile", {**PRIVACY_DEFAULTS["percentile"], "gamma": 0.5}),
    "percentile-gamma-0.1": _option("percentile", {**PRIVACY_DEFAULTS["percentile"], "gamma": 0.1}),
    "percentile-nvflare": _option("percentile", NVFLARE_DEFAULTS["percentile"]),
    "percentile-95": _option("percentile", {**PRIVACY_DEFAULTS["percentile"], "percentile": 95}),
    "svt": _option("svt", PRIVACY_DEFAULTS["svt"]),
    "svt-noise-var-1e4": _option("svt", {**PRIVACY_DEFAULTS["svt"], "noise_var": 10000}),
    "svt-gamma-0.1": _option("svt", {**PRIVACY_DEFAULTS["svt"], "gamma": 0.1, "noise_var": 10000}),
    "svt-half": _option("svt", {**PRIVACY_DEFAULTS["svt"], "fraction": 0.5}),
    "svt-nvflare": _option("svt", NVFLARE_DEFAULTS["svt"]),
}
"""The measured options: off, cxrfl's defaults, NVFlare's defaults, and settings that keep less."""


@dataclass(frozen=True)
class PrivacyBenchSettings(LocalTraining):
    """Settings of the privacy benchmark (every option shares them; the sites' training: LocalTraining).

    Args:
        profile: benchmark profile (:func:`cxrfl.bench.profiles.prepare`; default the real NIH images).
        seeds: training seeds 0 ... seeds-1.
        rounds: federated rounds after the warm-up.
        patience: rounds without improvement before stopping.
        options: names in :data:`OPTIONS` (``none`` always runs: the reference).
        threads: torch CPU threads.
    """

    profile: str = field(default="nih1000", metadata={"choices": PROFILE_NAMES})
    seeds: int = field(default=3, metadata={"ge": 1})
    rounds: int = field(default=15, metadata={"ge": 1})
    patience: int = field(default=3, metadata={"ge": 1})
    options: tuple[str, ...] = tuple(OPTIONS)
    threads: int = field(default=1, metadata={"ge": 1})

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [o for o in self.options if o not in OPTIONS]
        if unknown:
            self.fail("options", f"has unknown privacy option(s) {unknown}; known: {list(OPTIONS)}")
        object.__setattr__(self, "options", ("none", *(o for o in self.options if o != "none")))

    def server_config(self, seed: int) -> SurgicalConfig:
        """The server settings of one run."""
        train = self.train_config(seed)
        return surgical_config(
            train, rounds=self.rounds, patience=self.patience, image_size=self.image_size, arch=self.arch
        )


class FilteredHost:
    """A site host whose ``train`` answers leave through a privacy filter as the job's
    :class:`cxrfl.fl.privacy.UpdatePrivacy` sends them; each is measured into ``rows``.

    Args:
        host: the site's host.
        privacy: ``{"method", "args"}``.
        rows: where one measurement per answer goes.
        tag: entries every row carries (option, seed).
    """

    def __init__(
        self, host: Any, privacy: Mapping[str, Any], rows: list[dict[str, Any]], tag: Mapping[str, Any]
    ) -> None:
        from cxrfl.fl.privacy import make_inner_filter

        self.host = host
        self.tasks = host.tasks
        self.inner = make_inner_filter(privacy["method"], dict(privacy["args"]))  # one per site and run, as in a job
        self.rows = rows
        self.tag = dict(tag)

    def handle(self, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]) -> tuple[dict, dict]:
        out, answer = self.host.handle(task, params, meta)
        if task != TRAIN:
            return out, answer
        sent, row = filter_update(self.inner, out, params, int(meta.get("round", 0)))
        self.rows.append({**self.tag, "site": self.host.data.site, "phase": meta.get("phase"), **row})
        return sent, answer

    def describe(self, task: str, meta: Mapping[str, Any], answer: Mapping[str, Any]) -> str | None:
        return self.host.describe(task, meta, answer)

    def scalars(self, task: str, answer: Mapping[str, Any]) -> tuple[dict[str, float], int] | None:
        return self.host.scalars(task, answer)


def filter_update(
    inner: Any, result: Mapping[str, Any], received: Mapping[str, Any], rnd: int
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A site's answer through a filter as :class:`cxrfl.fl.privacy.UpdatePrivacy` sends it, and
    its measurement (round, per-part fidelity, SVT epsilon of the call and of the run so far).

    Args:
        inner: NVFlare's filter (:func:`cxrfl.fl.privacy.make_inner_filter`).
        result: the site's parameters.
        received: what it received for the task.
        rnd: the round (0: the warm-up).
    """
    from cxrfl.fl.privacy import privatize_update, svt_epsilon

    sent, meta = privatize_update(inner, dict(result), dict(received), current_round=rnd)
    eps_call, eps_run = svt_epsilon(meta)
    parts = fidelity(result, received, sent, HEAD_PREFIX)
    return sent, {"round": rnd, "parts": parts, "epsilon": eps_call, "epsilon_run": eps_run}


def sample_updates(
    site: SiteData, model_config: ModelConfig, train_config: TrainConfig, state_dir: str | Path
) -> list[tuple[str, dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """A site's real head warm-up and first round: ``(phase, received, result)`` each.

    Args:
        site: the site's data.
        model_config: network settings.
        train_config: training settings (``max_steps_per_epoch`` keeps it short).
        state_dir: the learner's state folder.
    """
    learner = SiteLearner(site, state_dir, model_config=model_config, train_config=train_config)
    init = {k: v for k, v in learner.outgoing_params().items() if not k.startswith(HEAD_PREFIX)}
    warm = learner.warmup(dict(init)).params
    received = {k: np.array(v, copy=True) for k, v in warm.items()}
    trained = learner.train_round(dict(received), 1).params
    return [("warmup", init, warm), ("train", received, trained)]


def _mean_auroc(result: Any, model_config: ModelConfig, tests: Mapping[str, Any]) -> float | None:
    """The selected global model's mean AUROC over the external test sets' classes."""
    model = global_model(result, model_config)
    means = []
    for test in tests.values():
        aurocs = per_class_auroc(test.labels, scores_on(model, result.classes, test), test.classes)
        mean = summarise_auroc(aurocs, model_classes=result.classes)["mean"]
        if mean is not None:
            means.append(mean)
    return float(np.mean(means)) if means else None


def run_privacy(
    settings: PrivacyBenchSettings, out: str | Path, *, log: Log = print, data_dir: str | Path | None = None
) -> dict[str, Any]:
    """Run every option for every seed; write ``results.json`` and ``report.md``.

    Args:
        settings: the benchmark's settings.
        out: output folder.
        log: progress callback.
        data_dir: where profile data is written (default ``out/data``).

    Returns:
        the results written to ``results.json``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(settings.threads)
    start = time.perf_counter()
    data, tests = load_profile(settings.profile, out, image_size=settings.image_size, data_dir=data_dir)
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="cxrfl-privacy-"))
    try:
        for seed in range(settings.seeds):
            warmups = WarmupCache()
            for name in settings.options:
                runs.append(_run_option(name, seed, settings, data.sites, tests, work, warmups, rows))
                log(
                    f"[{time.perf_counter() - start:7.0f}s] seed {seed} {name}: mean AUROC "
                    f"{num(runs[-1]['mean_auroc'])} (best round {runs[-1]['best_round']})"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "settings": asdict(settings),
        "profile": data.profile,
        "notes": data.notes,
        "code": code_version(),
        "machine": machine(torch.device("cpu")),
        "tests": {n: t.n for n, t in tests.items()},
        "options": summarise(settings, rows, runs),
        "runs": runs,
        "measurements": rows,
        "seconds": time.perf_counter() - start,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=json_default))
    (out / "report.md").write_text(format_report(results))
    plot_curves(results, out / "learning_curves.png")
    log(f"wrote {out / 'results.json'}, {out / 'report.md'} and {out / 'learning_curves.png'}")
    return results


def _run_option(
    name: str,
    seed: int,
    settings: PrivacyBenchSettings,
    sites: Sequence[SiteData],
    tests: Mapping[str, Any],
    work: Path,
    warmups: WarmupCache,
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """One run of one option and seed."""
    privacy = OPTIONS[name]
    hosts: dict[str, Any] = make_hosts(sites, work / name / str(seed) / "sites", warmups=warmups)
    if privacy is not None:
        hosts = {s: FilteredHost(h, privacy, rows, {"option": name, "seed": seed}) for s, h in hosts.items()}
    config = settings.server_config(seed)
    result = run_surgical(hosts, config, work / name / str(seed) / "server")
    shutil.rmtree(work / name / str(seed), ignore_errors=True)
    return {
        "option": name,
        "seed": seed,
        "best_round": result.best_round,
        "rounds": result.rounds,
        "mean_auroc": _mean_auroc(result, config.model_config, tests),
        "val_loss": result.curve("mean_val_loss"),
        "val_auroc": result.curve("mean_val_auroc"),
    }


def plot_curves(results: Mapping[str, Any], path: Path) -> None:
    """Every run's learning curve (the sites' mean validation loss and AUROC per round), one colour per option.

    Args:
        results: what :func:`run_privacy` writes.
        path: PNG file.
    """
    from cxrfl.bench.plots import curves_by

    title = f"{results['profile']}, privacy options"
    curves_by(results["runs"], "option", results["options"], title, results["settings"]["seeds"], path)


def _check(privacy: Mapping[str, Any] | None) -> str:
    """What cxrfl's job check says about an option: ``off``, ``ok``, ``warned: ...`` or ``refused: ...``."""
    if privacy is None:
        return "off"
    said: list[str] = []
    try:
        check_privacy(privacy, "option", warn=said.append)
    except ConfigError as exc:
        return "refused: " + str(exc).split(": ", 1)[1]
    return "warned: " + " / ".join(s.split(": ", 1)[1] for s in said) if said else "ok"


def summarise(
    settings: PrivacyBenchSettings, rows: Sequence[Mapping[str, Any]], runs: Sequence[Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per option: mean fidelity per phase and part, SVT epsilon, mean AUROC and its change against ``none``.

    Args:
        settings: the benchmark's settings.
        rows: the per-answer measurements.
        runs: the runs.
    """
    reference = {r["seed"]: r["mean_auroc"] for r in runs if r["option"] == "none"}
    out: dict[str, dict[str, Any]] = {}
    for name in settings.options:
        mine = [r for r in rows if r["option"] == name]
        fid = {
            phase: {
                part: {
                    k: finite_mean(
                        r["parts"][part][k]
                        for r in mine
                        if r["phase"] == phase and part in r["parts"] and r["parts"][part]["entries"]
                    )
                    for k in ("cosine", "relative_norm", "kept")
                }
                for part in PARTS
            }
            for phase in ("warmup", "train")
        }
        per_site_run: dict[tuple[Any, Any], float] = {}
        for r in mine:
            if r["epsilon_run"] is not None:
                key = (r["seed"], r["site"])
                per_site_run[key] = max(per_site_run.get(key, 0.0), r["epsilon_run"])
        aurocs = [r for r in runs if r["option"] == name]
        deltas = [
            r["mean_auroc"] - reference[r["seed"]]
            for r in aurocs
            if r["mean_auroc"] is not None and reference.get(r["seed"]) is not None
        ]
        out[name] = {
            "privacy": OPTIONS[name],
            "check": _check(OPTIONS[name]),
            "fidelity": fid,
            "epsilon_per_round": finite_mean(r["epsilon"] for r in mine if r["phase"] == "train"),
            "epsilon_run": finite_mean(per_site_run.values()),
            "mean_auroc": finite_mean(r["mean_auroc"] for r in aurocs),
            "auroc_change": finite_mean(deltas),
            "auroc_change_sd": float(np.std(deltas, ddof=1)) if len(deltas) > 1 else None,
        }
    return out


def format_report(results: Mapping[str, Any]) -> str:
    """The Markdown report: one row per option.

    Args:
        results: what :func:`run_privacy` returns.
    """
    s = results["settings"]
    lines = [
        f"# Privacy filters on surgical aggregation ({results['profile']})",
        "",
        f"{s['seeds']} seed(s), {s['image_size']} px, rounds of {_steps(s['steps'])} until the mean "
        "validation loss has not "
        f"improved for {s['patience']} (at most {s['rounds']}), lr {s['lr']:g}; "
        f"test images: {results['tests']}. Cosine and norm: the sent vs the true update of each site answer "
        "(mean over sites, rounds and seeds); kept: share of the changed entries sent; epsilon: NVFlare's "
        "SVT accountant per round and over the run (per site); AUROC: the selected model on the external "
        "test set, change against the unfiltered run of the same seed.",
        "",
        "| option | settings | cxrfl check | warm-up head cos / norm | weights cos / norm / kept | BatchNorm stats "
        "cos / norm | head cos / norm / kept | epsilon per round | epsilon over the run | mean AUROC | change |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, o in results["options"].items():
        warm, train = o["fidelity"]["warmup"]["head"], o["fidelity"]["train"]
        fe, bn, head = train["feature_extractor"], train["batchnorm_statistics"], train["head"]
        settings = "-" if o["privacy"] is None else ", ".join(f"{k}={v}" for k, v in o["privacy"]["args"].items())
        change = num(o["auroc_change"]) + (
            f" +- {num(o['auroc_change_sd'])}" if o["auroc_change_sd"] is not None else ""
        )
        lines.append(
            f"| {name} | {settings} | {o['check']} | {num(warm['cosine'])} / {num(warm['relative_norm'])} | "
            f"{num(fe['cosine'])} / {num(fe['relative_norm'])} / {num(fe['kept'])} | {num(bn['cosine'])} / "
            f"{num(bn['relative_norm'])} | {num(head['cosine'])} / {num(head['relative_norm'])} / "
            f"{num(head['kept'])} | {_eps(o['epsilon_per_round'])} | {_eps(o['epsilon_run'])} | "
            f"{num(o['mean_auroc'])} | {change} |"
        )
    code, where = results.get("code"), results.get("machine")
    if code and where:  # results written before they recorded both have neither
        lines += [
            "",
            f"Commit {(code['commit'] or '?')[:7]}{' (modified)' if code['dirty'] else ''}; {where['cpu']}, "
            f"{where['usable_cores']} usable cores, {where['torch_threads']} torch thread(s); "
            f"wall time {results['seconds'] / 60:.0f} min.",
        ]
    return "\n".join(lines + [""] + [f"- {n}" for n in results["notes"]]) + "\n"


def _steps(steps: int | None) -> str:
    return "one epoch over each site's split" if steps is None else f"at most {steps} steps per site"


def _eps(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"
