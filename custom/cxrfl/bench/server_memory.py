"""What a surgical server holds during a round, without training or NVFlare: a cheap harness for
``cxrfl bench load --harness``.

The job's server loop (:class:`cxrfl.surgical.server.SurgicalServer`) runs over K stub sites
that answer at once with a full DenseNet121 update (the received feature extractor, slightly
changed, and head rows of their own classes), through a transport that serialises every message
with NVFlare's FOBS both ways, as the job's transport does. Peak resident memory of this process
is sampled during the rounds, once streaming the answers into the aggregator (the job's way) and
once collecting every answer first (the way before), each in a fresh process so the two do not
share an allocator; tracemalloc names the largest Python/numpy holders at the peak.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from cxrfl.surgical.server import SurgicalServer

logger = logging.getLogger(__name__)
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class _Peak(threading.Thread):
    """Samples this process's RSS every millisecond until stopped: the peak of the whole run
    (:meth:`stop`) and since the last :meth:`take`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = self.top = _rss()
        self._halt = threading.Event()

    def _sample(self) -> None:
        rss = _rss()
        self.peak, self.top = max(self.peak, rss), max(self.top, rss)

    def run(self) -> None:
        while not self._halt.is_set():
            self._sample()
            time.sleep(0.001)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        self._sample()
        return self.top

    def take(self) -> int:
        """The peak since the last call (sampling goes on from the current RSS)."""
        self._sample()
        peak, self.peak = self.peak, _rss()
        return peak


def _fobs_transport(hosts: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    """A Send that serialises each payload and each answer with NVFlare's FOBS, as the job does."""
    from cxrfl.fl.wire import carry as wire

    def send(task: str, payloads: dict[str, Any], *, on_answer: Callable | None = None) -> dict[str, Any]:
        out = {}
        for site, (params, meta) in payloads.items():
            answer = wire(*hosts[site].handle(task, *wire(dict(params), dict(meta))))
            if on_answer is not None:
                on_answer(site, answer)
                answer = ({}, answer[1])
            out[site] = answer
        return out

    return send


class _StubSite:
    """Answers at once with the received feature extractor (times 1.001) and rows of its classes."""

    tasks = ("train", "validate")

    def __init__(self, classes: list[str], n_in: int) -> None:
        self.classes, self.n_in = classes, n_in

    def handle(self, task: str, params: dict[str, Any], meta: dict[str, Any]) -> tuple[dict, dict]:
        from cxrfl.nn.models import HEAD_PREFIX

        if task == "validate":
            return {}, {"metrics": {"loss": 1.0, "mean_auroc": 0.5}}
        out = {
            k: v * np.float32(1.001) if v.dtype == np.float32 else v.copy()
            for k, v in params.items()
            if not k.startswith(HEAD_PREFIX)
        }
        out[HEAD_PREFIX + "weight"] = np.full((len(self.classes), self.n_in), 0.1, np.float32)
        out[HEAD_PREFIX + "bias"] = np.zeros(len(self.classes), np.float32)
        return out, {"classes": self.classes, "num_samples": 10, "metrics": {"val_loss": 1.0, "val_mean_auroc": 0.5}}

    def describe(self, task: str, meta: dict, answer: dict) -> None:
        return None

    def scalars(self, task: str, answer: dict) -> None:
        return None


def _collect_first(send: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """The way before streaming: every answer is held until the last one arrived, then aggregated."""

    def wrapped(task: str, payloads: dict[str, Any], *, on_answer: Callable | None = None) -> dict[str, Any]:
        answers = send(task, payloads)
        for site, answer in answers.items() if on_answer is not None else ():
            on_answer(site, answer)
        return answers

    return wrapped


def _stub_sites(sites: int, n_in: int) -> dict[str, _StubSite]:
    """``sites`` stub sites, alternately NIH's and CheXpert's classes, each without two of them (partial overlap).

    Args:
        sites: how many.
        n_in: the head's input features.
    """
    from cxrfl.data.labels import CHEXPERT_CLASSES, NIH_CLASSES

    hosts = {}
    for k in range(sites):
        classes = sorted(NIH_CLASSES if k % 2 == 0 else CHEXPERT_CLASSES)
        hosts[f"site-{k + 1:02d}"] = _StubSite(
            [c for i, c in enumerate(classes) if i not in (k % len(classes), (k + 5) % len(classes))], n_in
        )
    return hosts


def _server(sites: int, rounds: int, streaming: bool, out_dir: str) -> SurgicalServer:
    """A :class:`~cxrfl.surgical.server.SurgicalServer` over ``sites`` stub sites (DenseNet121 at 32 px).

    Args:
        sites: stub sites.
        rounds: federated rounds after the warm-up.
        streaming: answers streamed into the aggregator (False: all collected first).
        out_dir: the server's folder.
    """
    from cxrfl.nn.models import ModelConfig, build_model
    from cxrfl.surgical.config import SurgicalConfig
    from cxrfl.surgical.server import SurgicalServer

    model = ModelConfig(image_size=32)  # DenseNet121's parameters do not depend on the image size
    hosts = _stub_sites(sites, build_model(model, 1).classifier.in_features)
    send = _fobs_transport(hosts)
    cfg = SurgicalConfig.from_dict(
        {
            "num_rounds": rounds,
            "min_clients": 2,
            "model_config": model,
            "patience": rounds + 1,
            "evaluate_test": False,
            "train_config": {"warmup_epochs": 1},
        }
    )
    return SurgicalServer(
        send if streaming else _collect_first(send),
        config=cfg,
        sites=list(hosts),
        out_dir=out_dir,
        run_id="harness",
        info=lambda m: None,
    )


def measure(sites: int, rounds: int, streaming: bool) -> dict[str, Any]:
    """Run the server loop over ``sites`` stub sites in this process; its peak memory.

    Args:
        sites: stub sites.
        rounds: federated rounds after the warm-up.
        streaming: answers streamed into the aggregator (False: all collected first).
    """
    import gc

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="cxrfl-server-memory-") as tmp:
        server = _server(sites, rounds, streaming, tmp)
        gc.collect()
        base = _rss()
        tracemalloc.start()
        peak = _Peak()
        peak.start()
        phases: dict[str, dict[str, float]] = {}

        def phase_done(name: str, record: Any) -> None:  # the peaks of the phase this record closes
            phases[f"{record.get('phase')} {record.get('round')}"] = {
                "rss_peak_mb": round(peak.take() / 2**20, 1),
                "traced_peak_mb": round(tracemalloc.get_traced_memory()[1] / 2**20, 1),
            }
            tracemalloc.reset_peak()

        server.on_record = phase_done
        start = time.perf_counter()
        server.run()
        seconds = time.perf_counter() - start
        top = peak.stop()
        tracemalloc.stop()
        update = sum(v.nbytes for v in server.state.params.values())
    return {
        "sites": sites,
        "rounds": rounds,
        "streaming": streaming,
        "update_mb": round(update / 2**20, 1),
        "rss_before_mb": round(base / 2**20, 1),
        "rss_peak_mb": round(top / 2**20, 1),
        "rss_growth_mb": round((top - base) / 2**20, 1),
        "traced_peak_mb": max((p["traced_peak_mb"] for p in phases.values()), default=0.0),
        "phases": phases,
        "seconds": round(seconds, 1),
    }


def run_harness(sites: int, rounds: int = 2, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """:func:`measure` streaming and collecting first, each in a fresh process.

    Args:
        sites: stub sites.
        rounds: rounds after the warm-up.
        log: progress lines.
    """
    out: dict[str, Any] = {"sites": sites, "rounds": rounds}
    for streaming in (True, False):
        code = (
            f"import json; from cxrfl.bench.server_memory import measure; "
            f"print(json.dumps(measure({sites}, {rounds}, {streaming})))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=3600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the server-memory harness failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        out["streaming" if streaming else "collect_first"] = row
        phases = "; ".join(f"{name}: {p['traced_peak_mb']} MB" for name, p in row["phases"].items())
        log(
            f"{sites} stub sites, {'streaming' if streaming else 'collecting first'}: peak RSS {row['rss_peak_mb']} MB "
            f"({row['rss_growth_mb']} MB over the {row['rss_before_mb']} MB before the run; one update "
            f"{row['update_mb']} MB); numpy/Python peak per phase: {phases}"
        )
    return out


def write_harness(result: dict[str, Any], out: str | Path) -> Path:
    """Write ``OUT/server_memory_<sites>.json``.

    Args:
        result: :func:`run_harness`'s result.
        out: the output folder.
    """
    from cxrfl.common.io import write_json

    return write_json(Path(out) / f"server_memory_{result['sites']}.json", result)
