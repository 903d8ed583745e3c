"""Part ``aggregation`` of ``cxrfl bench speed``: K full DenseNet121 updates aggregated by the job's
path and by NVFlare's FedAvg, on a quiet machine or with the cores busy.

Methods (:func:`aggregate_with`): ``round_aggregator`` is what the job's server does with a
round (:class:`cxrfl.surgical.round_aggregator.RoundAggregator`: every update validated and
summed as it arrives, the head stitched at the end); ``surgical`` the core function
:func:`cxrfl.surgical.aggregation.surgical_aggregate`; ``surgical_nvflare`` the NVFlare component
:class:`cxrfl.fl.aggregator.SurgicalAggregator` (for NVFlare's own workflows); ``nvflare_fedavg``
NVFlare's ``InTimeAccumulateWeightedAggregator`` doing plain FedAvg of the same updates (its
``accept`` calls plus ``aggregate``). Times are medians of repeats with the methods taking turns,
at torch's default thread count (cxrfl pins its aggregation to one thread itself); ``busy``
busy-loop processes load the cores meanwhile. Peak extra resident memory of each is measured in
a fresh process (``MALLOC_MMAP_THRESHOLD_`` fixed so freed buffers leave the process) by
sampling ``/proc/self/statm`` during the aggregation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from cxrfl.data.labels import CHEXPERT_CLASSES, NIH_CLASSES

logger = logging.getLogger(__name__)

AGG_METHODS = ("round_aggregator", "surgical", "surgical_nvflare", "nvflare_fedavg")
CXRFL_METHODS = AGG_METHODS[:3]

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading, time, os
    from cxrfl.bench.speed_aggregation import make_updates, aggregate_with
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
    from cxrfl.common.io import to_numpy
    from cxrfl.nn.models import ModelConfig, build_model

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
    from cxrfl.nn.models import HEAD_PREFIX

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
        params = {
            key: (v * scale if v.dtype == np.float32 else v.copy())
            for key, v in base.items()
            if not key.startswith(HEAD_PREFIX)
        }
        full_head = {HEAD_PREFIX + "weight": w * scale, HEAD_PREFIX + "bias": b * scale}
        params[HEAD_PREFIX + "weight"] = full_head[HEAD_PREFIX + "weight"][rows]
        params[HEAD_PREFIX + "bias"] = full_head[HEAD_PREFIX + "bias"][rows]
        updates.append(
            {"site": f"site-{i + 1}", "classes": classes, "params": params, "num_samples": 100, "full_head": full_head}
        )
    shapes = {key: v.shape for key, v in base.items() if not key.startswith(HEAD_PREFIX)}
    return updates, shapes


def _nvflare_fedavg(updates: list[dict[str, Any]]) -> Any:
    from nvflare.apis.dxo import DXO, DataKind, MetaKey
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.aggregators.intime_accumulate_model_aggregator import InTimeAccumulateWeightedAggregator
    from nvflare.app_common.app_constant import AppConstants

    logging.getLogger("nvflare").setLevel(logging.ERROR)  # no engine outside a job: it logs about that
    ctx = FLContext()
    ctx.set_prop(AppConstants.CURRENT_ROUND, 1, private=True, sticky=False)
    agg = InTimeAccumulateWeightedAggregator(
        expected_data_kind=DataKind.WEIGHTS, aggregation_weights={u["site"]: 1.0 for u in updates}
    )
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


def aggregate_with(method: str, updates: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]]) -> Any:
    """Run one aggregation of ``updates``.

    Args:
        method: one of :data:`AGG_METHODS` (see the module docstring).
        updates: from :func:`make_updates`.
        shapes: non-head shapes.
    """
    plain = [{k: u[k] for k in ("site", "classes", "params", "num_samples")} for u in updates]
    if method == "round_aggregator":
        from cxrfl.surgical.round_aggregator import RoundAggregator

        agg = RoundAggregator()
        agg.expect(shapes, {u["site"]: u["classes"] for u in updates})
        for u in plain:
            agg.accept(u)
        return agg.aggregate()
    if method == "surgical":
        from cxrfl.surgical.aggregation import surgical_aggregate

        return surgical_aggregate(plain)
    if method == "surgical_nvflare":
        from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

        from cxrfl.fl.aggregator import SurgicalAggregator

        agg = SurgicalAggregator()
        agg.expect(shapes, {u["site"]: u["classes"] for u in updates})
        for u in updates:
            agg.accept_model(
                FLModel(
                    params_type=ParamsType.FULL,
                    params=u["params"],
                    meta={"client_name": u["site"], "classes": u["classes"], "num_samples": u["num_samples"]},
                )
            )
        return agg.aggregate_model()
    if method == "nvflare_fedavg":
        return _nvflare_fedavg(updates)
    raise ValueError(f"unknown aggregation method {method!r}")


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[list[int]]:
    """``n`` busy-loop processes while the block runs (stopped after it, also on errors).

    Args:
        n: processes (0: none).
    """
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(1.0 if procs else 0.0)  # let them reach full speed
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def _timings(updates: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each method per repeat (one warm-up each; the methods take turns)."""
    seconds: dict[str, list[float]] = {method: [] for method in AGG_METHODS}
    for method in AGG_METHODS:
        aggregate_with(method, updates, shapes)
    for _ in range(repeats):
        for method in AGG_METHODS:
            t0 = time.perf_counter()
            aggregate_with(method, updates, shapes)
            seconds[method].append(time.perf_counter() - t0)
    return seconds


def _peak_memory(k: int, method: str) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(k), method], env=env, capture_output=True, text=True, timeout=1800
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}


def aggregation_benchmark(
    site_counts: tuple[int, ...],
    repeats: int,
    *,
    busy: int = 0,
    threads: int | None = None,
    memory: bool = True,
    log: Callable[[str], None] = logger.info,
) -> dict[str, Any]:
    """Time (median of repeats, in this process) and peak extra memory (fresh process) of every
    method for each K.

    Args:
        site_counts: K values.
        repeats: timing repeats.
        busy: busy-loop processes during the timings.
        threads: torch threads in this process (None: as it is, torch's default when not set).
        memory: also measure peak extra memory (a fresh process per method and K).
        log: progress callback.
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    model_bytes = int(sum(v.nbytes for v in model_state().values()))
    out: dict[str, Any] = {
        "model_bytes": model_bytes,
        "threads": torch.get_num_threads(),
        "busy": busy,
        "cpus": os.cpu_count(),
        "sites": {},
    }
    for k in site_counts:
        updates, shapes = make_updates(k)
        with busy_cores(busy):
            seconds = _timings(updates, shapes, repeats)
            out.setdefault("load_average_after", list(os.getloadavg()))
        row: dict[str, Any] = {}
        for method in AGG_METHODS:
            times = seconds[method]
            mem = _peak_memory(k, method) if memory else {}
            row[method] = {
                "seconds": times,
                "median_seconds": statistics.median(times),
                "min_seconds": min(times),
                "memory": mem,
                "extra_model_sizes": (mem["extra"] / model_bytes) if "extra" in mem else None,
            }
            log(
                f"aggregation K={k} {method}: {statistics.median(times):.3f}s"
                + (f", peak extra {mem['extra'] / 1e6:.0f} MB" if "extra" in mem else "")
            )
        fedavg, fastest = row["nvflare_fedavg"]["median_seconds"], row["nvflare_fedavg"]["min_seconds"]
        for method in CXRFL_METHODS:
            row[method]["ratio_to_nvflare_fedavg"] = row[method]["median_seconds"] / fedavg if fedavg else None
            row[method]["ratio_of_minima"] = row[method]["min_seconds"] / fastest if fastest else None
        out["sites"][str(k)] = row
        del updates
    return out


def aggregation_summary(agg: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` view: K = 10 (else the largest K), the job's path against NVFlare's FedAvg.

    Args:
        agg: :func:`aggregation_benchmark`'s result.
    """
    k = "10" if "10" in agg["sites"] else max(agg["sites"], key=int)
    row = agg["sites"][k]
    return {
        "sites": int(k),
        "nvflare_s": row["nvflare_fedavg"]["median_seconds"],
        "surgical_s": row["round_aggregator"]["median_seconds"],
        "ratio": row["round_aggregator"]["ratio_to_nvflare_fedavg"],
        "surgical_aggregate_s": row["surgical"]["median_seconds"],
        "surgical_aggregator_s": row["surgical_nvflare"]["median_seconds"],
        "threads": agg["threads"],
        "busy": agg["busy"],
        "load_average_after": agg.get("load_average_after"),
    }
