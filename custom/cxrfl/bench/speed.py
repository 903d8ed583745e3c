"""``cxrfl bench speed``: what the framework costs.

1. Local training throughput inside ``nvflare simulator`` (one site, ``-n 1 -t 1``, the site's
   own ``images_per_second`` from the job's round records) against a plain PyTorch loop
   (:func:`cxrfl.nn.training.train_epochs`, same data, model, settings and thread count), measured
   before and after the simulator run.
2. Aggregation of K full DenseNet121 updates (K = 2, 4, 10, 20): wall time of
   :func:`cxrfl.surgical.aggregation.surgical_aggregate` (and of the NVFlare-level
   :class:`cxrfl.fl.aggregator.SurgicalAggregator`, which also validates every update, summing
   it while checking it for NaN/Inf at accept time) against
   NVFlare's ``InTimeAccumulateWeightedAggregator`` doing plain FedAvg of the same updates (its
   ``accept`` calls plus ``aggregate``); peak extra resident memory of each, measured in a fresh
   process (``MALLOC_MMAP_THRESHOLD_`` fixed so freed buffers leave the process) by sampling
   ``/proc/self/statm`` during the aggregation.
3. Bytes a site receives and sends per round for each head mode, from the payloads
   (:func:`cxrfl.surgical.head_modes.payload_for`) of the two-hospitals label sets, as raw array bytes and
   as NVFlare's FOBS-serialised task data, against the full model.

``--only PARTS`` runs some of the three; the others are carried over from an earlier
``speed.json`` in the output folder (``carried_over`` says from which run).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from cxrfl.errors import ConfigError
from cxrfl.data.labels import CHEXPERT_CLASSES, NIH_CLASSES


@dataclass
class SpeedSettings:
    """Settings of the speed benchmark.

    Args:
        image_size: model input for the throughput comparison.
        batch_size: minibatch size.
        steps: training steps per round (local epoch cap).
        rounds: rounds of the one-site simulator job (and epochs of the plain loop).
        threads: torch CPU threads in both loops.
        site_counts: K of the aggregation benchmark.
        repeats: timing repeats per aggregation (median reported).
        skip_simulator: leave out part 1 (same as ``parts`` without ``simulator``).
        n_images: images of the synthetic site used in part 1.
        parts: the parts to run (``simulator``, ``aggregation``, ``payload``); the others are
            carried over from an earlier ``speed.json`` in the output folder when it has them.
    """

    image_size: int = 64
    batch_size: int = 16
    steps: int = 10
    rounds: int = 3
    threads: int = 2
    site_counts: tuple[int, ...] = (2, 4, 10, 20)
    repeats: int = 5
    skip_simulator: bool = False
    n_images: int = 300
    parts: tuple[str, ...] = ("simulator", "aggregation", "payload")


logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ 1. simulator vs plain loop
def _plain_throughput(config: Path, s: SpeedSettings) -> dict[str, Any]:
    import torch

    from cxrfl.data.dataset import make_loader
    from cxrfl.data.site import load_site
    from cxrfl.nn.models import ModelConfig, build_model
    from cxrfl.nn.training import TrainConfig, adam, train_epochs

    torch.set_num_threads(s.threads)
    data = load_site(config, check_images=False)
    tc = TrainConfig(lr=1e-3, batch_size=s.batch_size, max_steps_per_epoch=s.steps, augment=True, seed=0)
    torch.manual_seed(0)
    model = build_model(ModelConfig(image_size=s.image_size), len(data.classes))
    loader = make_loader(data.split_table("train"), data.classes, image_size=s.image_size, train=True,
                         batch_size=s.batch_size, seed=0)
    opt = adam(model, tc.lr)
    train_epochs(model, loader, opt, torch.device("cpu"), max_steps=2)  # allocator and kernel warm-up
    rates = []
    for _ in range(s.rounds):
        stats = train_epochs(model, loader, opt, torch.device("cpu"), max_steps=s.steps)
        rates.append(stats.images_per_second)
    return {"images_per_second": rates, "mean": float(np.mean(rates))}


def simulator_vs_plain(s: SpeedSettings, work: Path, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Part 1: throughput of the same local training inside the NVFlare simulator and in a plain loop.

    Args:
        s: settings.
        work: scratch folder.
        log: progress callback.
    """
    from cxrfl.jobs import DEMO_TRAIN, JOBS, write_job
    from cxrfl.nn.models import ModelConfig
    from cxrfl.synth import write_profile

    (config,) = write_profile("two-hospitals", work / "data", n_per_site=s.n_images, image_size=s.image_size,
                              sites=["hospital-a"])
    base = next(j for j in JOBS if j.name == "surgical_agg")
    train = replace(DEMO_TRAIN, batch_size=s.batch_size, max_steps_per_epoch=s.steps, warmup_epochs=1)
    args = {**base.controller_args, "num_rounds": s.rounds, "min_clients": 1, "patience": s.rounds + 1,
            "model_config": ModelConfig(image_size=s.image_size).to_dict(), "train_config": train.to_dict(),
            "evaluate_test": False, "keep_round_checkpoints": False}
    spec = replace(base, name="speed_one_site", controller_args=args, min_clients=1,
                   executor_args={**base.executor_args, "num_threads": s.threads})
    job = write_job(spec, work / "jobs")
    log("plain loop (before the simulator)")
    before = _plain_throughput(config, s)
    ws = work / "ws"
    env = {**os.environ, "CXRFL_SITE_CONFIG": str(config), "HOME": str(work / "home")}
    nvflare = str(Path(sys.executable).with_name("nvflare"))
    log(f"nvflare simulator {job.name} -n 1 -t 1 ({s.rounds} rounds of {s.steps} steps)")
    t0 = time.perf_counter()
    proc = subprocess.run([nvflare, "simulator", str(job), "-w", str(ws), "-n", "1", "-t", "1"], env=env,
                          capture_output=True, text=True, timeout=3600)
    sim_seconds = time.perf_counter() - t0
    records = ws / "server" / "simulate_job" / "app_server" / "cxrfl" / "rounds.jsonl"
    if not records.is_file():
        raise RuntimeError(f"the simulator left no round records (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rates = []
    for line in records.read_text().splitlines():
        rec = json.loads(line)
        for m in rec.get("site_metrics", {}).values():
            if m.get("images_per_second"):
                rates.append(float(m["images_per_second"]))
    log("plain loop (after the simulator)")
    after = _plain_throughput(config, s)
    plain = float(np.mean(before["images_per_second"] + after["images_per_second"]))
    sim = float(np.mean(rates)) if rates else float("nan")
    return {
        "simulator_images_per_second": rates,
        "simulator_mean": sim,
        "simulator_wall_seconds": sim_seconds,
        "plain_before": before,
        "plain_after": after,
        "plain_mean": plain,
        "ratio": sim / plain if plain else None,
        "command": f"nvflare simulator {job} -w {ws} -n 1 -t 1",
    }


# ------------------------------------------------------------------ 2. aggregation
_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading, time, os
    import torch
    torch.set_num_threads(1)
    from cxrfl.bench.speed import make_updates, aggregate_with
    k, method = int(sys.argv[1]), sys.argv[2]
    updates, shapes = make_updates(k)
    page = os.sysconf("SC_PAGE_SIZE")
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page
    import gc; gc.collect()
    base = rss(); peak = [base]; done = threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss()); time.sleep(0.0005)
    t = threading.Thread(target=sample, daemon=True); t.start()
    out = aggregate_with(method, updates, shapes)
    peak[0] = max(peak[0], rss()); done.set(); t.join()
    print(json.dumps({"baseline": base, "peak": peak[0], "extra": peak[0] - base}))
    """
)


def model_state() -> dict[str, np.ndarray]:
    """A full DenseNet121 state (feature extractor, BatchNorm buffers, a 20-class head) as numpy."""
    from cxrfl.nn.models import ModelConfig, build_model
    from cxrfl.common.io import to_numpy

    return to_numpy(build_model(ModelConfig(image_size=224), 20).state_dict())


def make_updates(k: int, seed: int = 0) -> tuple[list[dict[str, Any]], dict[str, tuple[int, ...]]]:
    """K distinct full-size site updates; site i has the 7 shared classes plus a random third of the rest.

    Args:
        k: number of sites.
        seed: random seed.

    Returns:
        (updates in :func:`cxrfl.surgical.aggregation.surgical_aggregate` form, each also carrying
        ``"full_head"``: the 20-row head a FedAvg site would send), non-head shapes.
    """
    from cxrfl.surgical.aggregation import HEAD_PREFIX

    base = model_state()
    union = sorted(set(NIH_CLASSES) | set(CHEXPERT_CLASSES))
    shared = sorted(set(NIH_CLASSES) & set(CHEXPERT_CLASSES))
    rest = [c for c in union if c not in shared]
    rng = np.random.default_rng(seed)
    w, b = base[HEAD_PREFIX + "weight"], base[HEAD_PREFIX + "bias"]
    updates = []
    for i in range(k):
        classes = sorted(set(shared) | set(rng.choice(rest, size=len(rest) // 3 + 1, replace=False)))
        rows = [union.index(c) for c in classes]
        scale = np.float32(1.0 + 0.01 * i)
        params = {key: (v * scale if v.dtype == np.float32 else v.copy()) for key, v in base.items()
                  if not key.startswith(HEAD_PREFIX)}
        full_head = {HEAD_PREFIX + "weight": w * scale, HEAD_PREFIX + "bias": b * scale}
        params[HEAD_PREFIX + "weight"] = full_head[HEAD_PREFIX + "weight"][rows]
        params[HEAD_PREFIX + "bias"] = full_head[HEAD_PREFIX + "bias"][rows]
        updates.append({"site": f"site-{i + 1}", "classes": classes, "params": params, "num_samples": 100,
                        "full_head": full_head})
    shapes = {key: v.shape for key, v in base.items() if not key.startswith(HEAD_PREFIX)}
    return updates, shapes


def aggregate_with(method: str, updates: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]]) -> Any:
    """Run one aggregation of ``updates``.

    Args:
        method: ``surgical`` (the core function), ``surgical_nvflare`` (cxrfl's NVFlare
            aggregator: validation + aggregation) or ``nvflare_fedavg`` (NVFlare's
            InTimeAccumulateWeightedAggregator on the full-head updates).
        updates: from :func:`make_updates`.
        shapes: non-head shapes.
    """
    if method == "surgical":
        from cxrfl.surgical.aggregation import surgical_aggregate

        return surgical_aggregate([{k: u[k] for k in ("site", "classes", "params", "num_samples")} for u in updates])
    if method == "surgical_nvflare":
        from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

        from cxrfl.fl.aggregator import SurgicalAggregator

        agg = SurgicalAggregator()
        agg.expect(shapes, {u["site"]: u["classes"] for u in updates})
        for u in updates:
            agg.accept_model(FLModel(params_type=ParamsType.FULL, params=u["params"],
                                     meta={"client_name": u["site"], "classes": u["classes"], "num_samples": u["num_samples"]}))
        return agg.aggregate_model()
    if method == "nvflare_fedavg":
        from nvflare.apis.dxo import DXO, DataKind, MetaKey
        from nvflare.apis.event_type import EventType
        from nvflare.apis.fl_constant import ReservedKey
        from nvflare.apis.fl_context import FLContext
        from nvflare.app_common.aggregators.intime_accumulate_model_aggregator import InTimeAccumulateWeightedAggregator
        from nvflare.app_common.app_constant import AppConstants

        logging.getLogger("nvflare").setLevel(logging.ERROR)  # no engine outside a job: it logs about that
        ctx = FLContext()
        ctx.set_prop(AppConstants.CURRENT_ROUND, 1, private=True, sticky=False)
        agg = InTimeAccumulateWeightedAggregator(expected_data_kind=DataKind.WEIGHTS,
                                                 aggregation_weights={u["site"]: 1.0 for u in updates})
        agg.handle_event(EventType.START_RUN, ctx)
        for u in updates:
            data = {k: v for k, v in u["params"].items() if not k.startswith("classifier.")}
            data.update(u["full_head"])
            shareable = DXO(data_kind=DataKind.WEIGHTS, data=data, meta={MetaKey.NUM_STEPS_CURRENT_ROUND: 1}).to_shareable()
            shareable.set_peer_props({ReservedKey.IDENTITY_NAME: u["site"]})
            shareable.add_cookie(AppConstants.CONTRIBUTION_ROUND, 1)
            if not agg.accept(shareable, ctx):
                raise RuntimeError(f"NVFlare's aggregator refused the update of {u['site']}")
        return agg.aggregate(ctx)
    raise ValueError(f"unknown aggregation method {method!r}")


AGG_METHODS = ("surgical", "surgical_nvflare", "nvflare_fedavg")
PARTS = ("simulator", "aggregation", "payload")


def aggregation_benchmark(s: SpeedSettings, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Part 2: time (median of repeats, in this process; the methods take turns within each
    repeat, so a change of machine load hits them alike) and peak extra memory (fresh process);
    one torch thread (NVFlare's aggregator runs single-threaded numpy).

    Args:
        s: settings.
        log: progress callback.
    """
    import torch

    torch.set_num_threads(1)  # NVFlare's aggregator is single-threaded numpy: compare like with like
    model_bytes = int(sum(v.nbytes for v in model_state().values()))
    out: dict[str, Any] = {"model_bytes": model_bytes, "threads": 1, "sites": {}}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "1"}
    for k in s.site_counts:
        updates, shapes = make_updates(k)
        row: dict[str, Any] = {}
        seconds: dict[str, list[float]] = {method: [] for method in AGG_METHODS}
        for method in AGG_METHODS:  # warm-up (imports, first allocations)
            aggregate_with(method, updates, shapes)
        for _ in range(s.repeats):
            for method in AGG_METHODS:
                t0 = time.perf_counter()
                aggregate_with(method, updates, shapes)
                seconds[method].append(time.perf_counter() - t0)
        for method in AGG_METHODS:
            times = seconds[method]
            proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(k), method], env=env, capture_output=True,
                                  text=True, timeout=1800)
            mem = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
            row[method] = {"seconds": times, "median_seconds": statistics.median(times), "min_seconds": min(times), "memory": mem,
                           "extra_model_sizes": (mem.get("extra", 0) / model_bytes) if "extra" in mem else None}
            log(f"aggregation K={k} {method}: {statistics.median(times):.3f}s, "
                f"peak extra {mem.get('extra', float('nan')) / 1e6:.0f} MB")
        fedavg, fastest = row["nvflare_fedavg"]["median_seconds"], row["nvflare_fedavg"]["min_seconds"]
        for method in ("surgical", "surgical_nvflare"):
            row[method]["ratio_to_nvflare_fedavg"] = row[method]["median_seconds"] / fedavg if fedavg else None
            row[method]["ratio_of_minima"] = row[method]["min_seconds"] / fastest if fastest else None
        out["sites"][str(k)] = row
        del updates
    return out


# ------------------------------------------------------------------ 3. payload
def payload_benchmark() -> dict[str, Any]:
    """Part 3: bytes per site per round for each head mode (two-hospitals label sets, full DenseNet121)."""
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.decomposers import common_decomposers
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils
    from nvflare.fuel.utils import fobs

    from cxrfl.surgical.head_modes import payload_for
    from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, batchnorm_keys, build_model

    common_decomposers.register()
    state = model_state()
    bn = set(batchnorm_keys(build_model(ModelConfig(image_size=224), 20)))
    union = sorted(set(NIH_CLASSES) | set(CHEXPERT_CLASSES))
    full_bytes = int(sum(v.nbytes for v in state.values()))
    body_bytes = int(sum(v.nbytes for k, v in state.items() if not k.startswith(HEAD_PREFIX)))
    row_bytes = int(state[HEAD_PREFIX + "weight"][0].nbytes + state[HEAD_PREFIX + "bias"][:1].nbytes)

    def wire(params: dict[str, Any], classes: list[str] | None) -> int:
        meta = {"classes": classes} if classes else {}
        return len(fobs.dumps(FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=params, meta=meta))))

    sites = {"hospital-a (NIH, 14)": list(NIH_CLASSES), "hospital-b (CheXpert, 13)": list(CHEXPERT_CLASSES)}
    modes = {"surgical": ("surgical", set()), "union (vanilla FL, partial loss)": ("union", set()),
             "local (personalized FL)": ("local", set()), "local + FedBN": ("local", bn)}
    out: dict[str, Any] = {"full_model_bytes": full_bytes, "feature_extractor_bytes": body_bytes, "head_row_bytes": row_bytes,
                           "union_classes": len(union), "full_model_wire_bytes": wire(state, union), "sites": {}}
    for site, classes in sites.items():
        rows = {}
        for label, (mode, exclude) in modes.items():
            params, sent = payload_for(state, union, classes, head_mode=mode, exclude=exclude)
            raw = int(sum(v.nbytes for v in params.values()))
            rows[label] = {"raw_bytes": raw, "wire_bytes": wire(params, sent), "fraction_of_full_model": raw / full_bytes,
                           "head_rows": int(params[HEAD_PREFIX + "weight"].shape[0]) if HEAD_PREFIX + "weight" in params else 0}
        expected = body_bytes + len(classes) * row_bytes
        rows["surgical"]["equals_feature_extractor_plus_own_rows"] = rows["surgical"]["raw_bytes"] == expected
        out["sites"][site] = rows
    return out


# ------------------------------------------------------------------ report
def format_speed(res: dict[str, Any]) -> str:
    """Markdown of the speed results (tables and one sentence per target)."""
    lines = ["## Framework overhead (`cxrfl bench speed`)", ""]
    m = res["machine"]
    lines += [f"Machine: {m['cpus']} CPU cores, CPU only, {res['settings']['threads']} torch thread(s); load average at start "
              f"{', '.join(f'{x:.1f}' for x in m['load_average_at_start'])} (other jobs were running: timings are noisy).", ""]
    for part, source in res.get("carried_over", {}).items():
        load = ", ".join(f"{x:.1f}" for x in (source.get("machine") or {}).get("load_average_at_start", []))
        lines += [f"The {part} part is carried over from an earlier run: `{source.get('command')}` (load average at its "
                  f"start {load or 'unknown'}).", ""]
    sim = res.get("simulator")
    if sim:
        s = (res.get("carried_over", {}).get("simulator") or {}).get("settings") or res["settings"]
        lines += ["### Local training inside the simulator vs a plain PyTorch loop", "",
                  f"DenseNet121, {s['image_size']}x{s['image_size']} px, batch {s['batch_size']}, {s['steps']} steps per round, "
                  f"{s['rounds']} rounds, one synthetic site; `{sim['command']}`.", "",
                  "| loop | images/s per round | mean |", "|---|---|---|",
                  f"| plain, before | {', '.join(f'{x:.1f}' for x in sim['plain_before']['images_per_second'])} | {sim['plain_before']['mean']:.1f} |",
                  f"| simulator (site metrics) | {', '.join(f'{x:.1f}' for x in sim['simulator_images_per_second'])} | {sim['simulator_mean']:.1f} |",
                  f"| plain, after | {', '.join(f'{x:.1f}' for x in sim['plain_after']['images_per_second'])} | {sim['plain_after']['mean']:.1f} |",
                  "", f"Ratio simulator / plain: **{sim['ratio']:.2f}x** (simulator run took {sim['simulator_wall_seconds']:.0f} s "
                  "wall time, mostly start-up).", ""]
    agg = res.get("aggregation")
    if agg:
        agg_settings = (res.get("carried_over", {}).get("aggregation") or {}).get("settings") or res["settings"]
        mb = agg["model_bytes"] / 1e6
        lines += ["### Aggregation of K full DenseNet121 updates", "",
                  f"One update = {mb:.1f} MB (float32 feature extractor, BatchNorm buffers and a 20-class head; FedAvg sites send all "
                  "20 rows, surgical sites the 7 shared classes plus a random third of the others). Median of "
                  f"{agg_settings['repeats']} repeats, the methods taking turns within each repeat (in brackets: the ratio of the "
                  "fastest repeats, less affected by other jobs); peak extra memory in a fresh process.", "",
                  "| K | NVFlare FedAvg (s) | surgical_aggregate (s) | ratio | SurgicalAggregator incl. validation (s) | ratio | "
                  "peak extra: NVFlare | surgical_aggregate | SurgicalAggregator |", "|---|---|---|---|---|---|---|---|---|"]
        for k, row in agg["sites"].items():
            def extra(method: str) -> str:
                v = row[method]["extra_model_sizes"]
                return "-" if v is None else f"{row[method]['memory']['extra'] / 1e6:.0f} MB ({v:.2f} models)"
            def ratio(method: str) -> str:
                r, q = row[method]["ratio_to_nvflare_fedavg"], row[method].get("ratio_of_minima")
                return f"{r:.2f}" + (f" ({q:.2f})" if q is not None else "")
            lines.append(f"| {k} | {row['nvflare_fedavg']['median_seconds']:.3f} | {row['surgical']['median_seconds']:.3f} | "
                         f"{ratio('surgical')} | {row['surgical_nvflare']['median_seconds']:.3f} | "
                         f"{ratio('surgical_nvflare')} | {extra('nvflare_fedavg')} | {extra('surgical')} | "
                         f"{extra('surgical_nvflare')} |")
    pay = res.get("payload")
    if pay:
        lines += ["", "### Bytes per site per round", "",
                  f"Full model: {pay['full_model_bytes'] / 1e6:.2f} MB raw ({pay['full_model_wire_bytes'] / 1e6:.2f} MB as FOBS task data); "
                  f"feature extractor {pay['feature_extractor_bytes'] / 1e6:.2f} MB; one head row {pay['head_row_bytes']} bytes. "
                  "Down = up for every mode (a site sends back what it received, trained).", "",
                  "| site | head mode | head rows | raw MB | FOBS MB | of the full model |", "|---|---|---|---|---|---|"]
        for site, rows in pay["sites"].items():
            for mode, r in rows.items():
                lines.append(f"| {site} | {mode} | {r['head_rows']} | {r['raw_bytes'] / 1e6:.3f} | {r['wire_bytes'] / 1e6:.3f} | "
                             f"{r['fraction_of_full_model']:.4f} |")
    lines += ["", "### Targets", ""] + [f"- {t}" for t in speed_verdicts(res)] + [""]
    return "\n".join(lines)


def speed_verdicts(res: dict[str, Any]) -> list[str]:
    """One sentence per framework-overhead target."""
    out = []
    sim = res.get("simulator")
    if sim and sim.get("ratio") is not None:
        ok = sim["ratio"] >= 0.9
        out.append(f"Training inside the simulator at least 0.9x the plain loop's images/s: **{'MET' if ok else 'NOT MET'}** "
                   f"({sim['ratio']:.2f}x: {sim['simulator_mean']:.1f} vs {sim['plain_mean']:.1f} images/s).")
    row = (res.get("aggregation") or {}).get("sites", {}).get("10")
    if row:
        r = row["surgical"]["ratio_to_nvflare_fedavg"]
        rn = row["surgical_nvflare"]["ratio_to_nvflare_fedavg"]
        out.append(f"Surgical aggregation (`surgical_aggregate`) of 10 updates within 1.5x NVFlare's "
                   f"InTimeAccumulateWeightedAggregator FedAvg: **{'MET' if r <= 1.5 else 'NOT MET'}** "
                   f"({row['surgical']['median_seconds']:.3f} s vs {row['nvflare_fedavg']['median_seconds']:.3f} s = {r:.2f}x).")
        fastest = row["surgical_nvflare"].get("ratio_of_minima")
        out.append(f"The same through the job's NVFlare component (`SurgicalAggregator`: every update validated, then "
                   f"aggregated) within 1.5x: **{'MET' if rn <= 1.5 else 'NOT MET'}** "
                   f"({row['surgical_nvflare']['median_seconds']:.3f} s = {rn:.2f}x"
                   + (f"; fastest repeats {fastest:.2f}x" if fastest is not None else "") + ").")
        ex = row["surgical"]["extra_model_sizes"]
        if ex is not None:
            out.append(f"Peak extra memory of aggregating 10 updates under 3 model sizes: **{'MET' if ex < 3 else 'NOT MET'}** "
                       f"({ex:.2f} model sizes for surgical_aggregate; SurgicalAggregator "
                       f"{row['surgical_nvflare']['extra_model_sizes']:.2f}; NVFlare FedAvg {row['nvflare_fedavg']['extra_model_sizes']:.2f}).")
    pay = res.get("payload")
    if not pay:
        return out
    ok = all(rows["surgical"]["equals_feature_extractor_plus_own_rows"] for rows in pay["sites"].values())
    detail = "; ".join(f"{site}: {rows['surgical']['raw_bytes'] / 1e6:.3f} MB = feature extractor + {rows['surgical']['head_rows']} rows "
                       f"({rows['surgical']['fraction_of_full_model']:.4f} of the full model)" for site, rows in pay["sites"].items())
    out.append(f"Per-round payload to a site = the feature extractor plus its own head rows only: **{'MET' if ok else 'NOT MET'}** ({detail}).")
    return out


def _earlier_results(path: Path, wanted: list[str]) -> dict[str, tuple[Any, dict[str, Any]]]:
    """The ``wanted`` parts of an earlier ``speed.json``: part -> (results, where they came from)."""
    if not wanted or not path.is_file():
        return {}
    prev = json.loads(path.read_text())
    found = {}
    for part in wanted:
        if part not in prev:
            continue
        source = prev.get("carried_over", {}).get(part) or {
            "command": prev.get("command"), "settings": prev.get("settings"), "machine": prev.get("machine")}
        found[part] = (prev[part], source)
    return found


def run_speed(s: SpeedSettings, out: Path, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Run the selected parts (``s.parts``); write ``speed.json`` and ``speed.md`` under ``out``.

    Parts not run this time are copied from an earlier ``speed.json`` there (with the command,
    settings and machine of the run that measured them, under ``carried_over``).

    Args:
        s: settings.
        out: output folder.
        log: progress callback.
    """
    import torch

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [p for p in PARTS if p in s.parts and not (p == "simulator" and s.skip_simulator)]
    unknown = sorted(set(s.parts) - set(PARTS))
    if unknown or not parts:
        raise ConfigError(f"--only must name some of {', '.join(PARTS)}, got {','.join(s.parts)!r}")
    earlier = _earlier_results(out / "speed.json", [p for p in PARTS if p not in parts])
    torch.set_num_threads(s.threads)
    res: dict[str, Any] = {
        "settings": asdict(s),
        "command": " ".join(["cxrfl", *sys.argv[1:]]) if Path(sys.argv[0]).name == "cxrfl" else None,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "load_average_at_start": list(os.getloadavg())},
    }
    if "simulator" in parts:
        with tempfile.TemporaryDirectory(prefix="cxrfl-speed-") as tmp:
            res["simulator"] = simulator_vs_plain(s, Path(tmp), log)
        log(f"simulator/plain = {res['simulator']['ratio']:.2f}")
    if "aggregation" in parts:
        res["aggregation"] = aggregation_benchmark(s, log)
    if "payload" in parts:
        res["payload"] = payload_benchmark()
    for part, (value, source) in earlier.items():
        res[part] = value
        res.setdefault("carried_over", {})[part] = source
        log(f"{part}: carried over from the earlier run ({source['command']})")
    res["verdicts"] = speed_verdicts(res)
    (out / "speed.json").write_text(json.dumps(res, indent=1))
    (out / "speed.md").write_text(format_speed(res))
    log(f"wrote {out / 'speed.json'} and {out / 'speed.md'}")
    return res
