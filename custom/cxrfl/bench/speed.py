"""``cxrfl bench speed``: what the framework costs, and what the default training settings buy.

1. ``simulator``: local training throughput inside ``nvflare simulator`` (one site, ``-n 1 -t 1``,
   the site's own ``images_per_second`` from the job's round records) against a plain PyTorch
   loop (:func:`cxrfl.nn.training.train_epochs`, same data, model, settings and thread count),
   measured before and after the simulator run.
2. ``training`` and ``accuracy`` (:mod:`cxrfl.bench.speed_training`): images/s of the default
   precision and memory format of this machine against float32 NCHW, interleaved in one run; and
   mean test AUROC after the same short training in both (``accuracy`` is long: not in the default
   parts).
3. ``aggregation`` (:mod:`cxrfl.bench.speed_aggregation`): K full DenseNet121 updates through the
   job's aggregation path against NVFlare's FedAvg aggregator, at torch's default thread count,
   optionally with ``busy`` busy-loop processes loading the cores.
4. ``payload``: bytes a site receives and sends per round for each head mode, from the payloads
   (:func:`cxrfl.surgical.head_modes.payload_for`) of the two-hospitals label sets, as raw array
   bytes and as NVFlare's FOBS-serialised task data, against the full model.

``--only PARTS`` runs some of them; the others are carried over from an earlier ``speed.json`` in
the output folder (``carried_over`` says from which run). :func:`json_summary` is what
``--json`` prints: one object with the headline numbers of the parts measured in this run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from cxrfl.bench.loading import LoadingSettings, loading_benchmark, loading_summary
from cxrfl.bench.protocol import command_line, machine
from cxrfl.bench.speed_aggregation import aggregation_benchmark, aggregation_summary, model_state
from cxrfl.bench.speed_report import format_speed, speed_verdicts
from cxrfl.bench.speed_training import TrainingSpeedSettings, accuracy_benchmark, training_benchmark
from cxrfl.common.config import Config
from cxrfl.data.labels import CHEXPERT_CLASSES, NIH_CLASSES

PARTS = ("simulator", "training", "aggregation", "payload", "accuracy", "loading")
"""The parts of ``cxrfl bench speed``, in the order they run."""


@dataclass(frozen=True)
class SpeedSettings(Config):
    """Settings of the speed benchmark.

    Args:
        image_size: model input for the throughput comparison.
        batch_size: minibatch size.
        steps: training steps per round (local epoch cap).
        rounds: rounds of the one-site simulator job (and epochs of the plain loop); timed
            repeats of each setting in the ``training`` part.
        threads: torch CPU threads of the training loops (0: torch's default).
        site_counts: K of the aggregation benchmark.
        repeats: timing repeats per aggregation (median reported).
        skip_simulator: leave out part 1 (same as ``parts`` without ``simulator``).
        n_images: images of the synthetic site used in part 1.
        parts: the parts to run (:data:`PARTS`); the others are carried over from an earlier
            ``speed.json`` in the output folder when it has them.
        busy: busy-loop processes loading the cores during the aggregation timings.
        training_batch_size: minibatch of the ``training`` and ``accuracy`` parts.
        epochs: training epochs of the ``accuracy`` part.
        seeds: seeds of the ``accuracy`` part.
        device: where the training parts run (``cpu`` or ``cuda``): ``training``, ``accuracy``,
            and both loops of ``simulator`` (its site and the plain loop, each on ``auto`` precision).
        loading: settings of the ``loading`` part (:mod:`cxrfl.bench.loading`; not in the default parts).
    """

    SECTION: ClassVar[str] = "bench"
    image_size: int = field(default=64, metadata={"ge": 32})
    batch_size: int = field(default=16, metadata={"ge": 1})
    steps: int = field(default=10, metadata={"ge": 1})
    rounds: int = field(default=3, metadata={"ge": 1})
    threads: int = field(default=2, metadata={"ge": 0})
    site_counts: tuple[int, ...] = (2, 4, 10, 20)
    repeats: int = field(default=5, metadata={"ge": 1})
    skip_simulator: bool = False
    n_images: int = field(default=300, metadata={"ge": 1})
    parts: tuple[str, ...] = ("simulator", "training", "aggregation", "payload")
    busy: int = field(default=0, metadata={"ge": 0})
    training_batch_size: int = field(default=32, metadata={"ge": 1})
    epochs: int = field(default=8, metadata={"ge": 1})
    seeds: int = field(default=3, metadata={"ge": 1})
    device: str = "cpu"
    loading: LoadingSettings = field(default_factory=LoadingSettings)

    def __post_init__(self) -> None:
        super().__post_init__()
        if sorted(set(self.parts) - set(PARTS)) or not self.measured():
            self.fail("parts", f"must name some of {', '.join(PARTS)} (--only), got {','.join(self.parts)!r}")

    def measured(self) -> list[str]:
        """The parts this run measures, in :data:`PARTS` order (``simulator`` not when ``skip_simulator``)."""
        return [p for p in PARTS if p in self.parts and not (p == "simulator" and self.skip_simulator)]

    def training(self) -> TrainingSpeedSettings:
        """The settings of the ``training`` and ``accuracy`` parts."""
        return TrainingSpeedSettings(
            image_size=self.image_size,
            batch_size=self.training_batch_size,
            steps=self.steps,
            repeats=self.rounds,
            threads=self.threads,
            epochs=self.epochs,
            seeds=self.seeds,
            accuracy_image_size=self.image_size,
            device=self.device,
        )


logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ 1. simulator vs plain loop
def _plain_throughput(config: Path, s: SpeedSettings) -> dict[str, Any]:
    import torch

    from cxrfl.data.dataset import make_loader
    from cxrfl.data.site import load_site
    from cxrfl.nn.models import ModelConfig, build_model, select_device
    from cxrfl.nn.training import TrainConfig, adam, train_epochs

    if s.threads:
        torch.set_num_threads(s.threads)
    data = load_site(config, check_images=False)
    tc = TrainConfig(lr=1e-3, batch_size=s.batch_size, max_steps_per_epoch=s.steps, augment=True, seed=0)
    torch.manual_seed(0)
    model = build_model(ModelConfig(image_size=s.image_size), len(data.classes))
    loader = make_loader(
        data.split_table("train"), data.classes, image_size=s.image_size, train=True, batch_size=s.batch_size, seed=0
    )
    opt = adam(model, tc.lr)
    device = select_device(s.device)  # both loops: this device's auto precision and memory format
    train_epochs(model, loader, opt, device, max_steps=2)  # allocator and kernel warm-up
    rates = []
    for _ in range(s.rounds):
        stats = train_epochs(model, loader, opt, device, max_steps=s.steps)
        rates.append(stats.images_per_second)
    return {"images_per_second": rates, "mean": float(np.mean(rates))}


def _one_site_job(s: SpeedSettings, out: Path) -> Path:
    """The README demo job (``surgical_agg``) for one site, with the benchmark's rounds, steps and threads.

    Args:
        s: settings.
        out: the parent folder of the job folder.
    """
    from cxrfl.jobs import DEMO_TRAIN, JOBS, write_job
    from cxrfl.nn.models import ModelConfig

    base = next(j for j in JOBS if j.name == "surgical_agg")
    train = replace(DEMO_TRAIN, batch_size=s.batch_size, max_steps_per_epoch=s.steps, warmup_epochs=1)
    args = {
        **base.controller_args,
        "num_rounds": s.rounds,
        "min_clients": 1,
        "patience": s.rounds + 1,
        "model_config": ModelConfig(image_size=s.image_size).to_dict(),
        "train_config": train.to_dict(),
        "evaluate_test": False,
        "keep_round_checkpoints": False,
    }
    spec = replace(
        base,
        name="speed_one_site",
        controller_args=args,
        min_clients=1,
        executor_args={**base.executor_args, "num_threads": s.threads, "device": s.device},
    )
    return write_job(spec, out)


def simulator_vs_plain(s: SpeedSettings, work: Path, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Part 1: throughput of the same local training inside the NVFlare simulator and in a plain loop.

    Args:
        s: settings.
        work: scratch folder.
        log: progress callback.
    """
    from cxrfl.synth import write_profile

    (config,) = write_profile(
        "two-hospitals", work / "data", n_per_site=s.n_images, image_size=s.image_size, sites=["hospital-a"]
    )
    job = _one_site_job(s, work / "jobs")
    log("plain loop (before the simulator)")
    before = _plain_throughput(config, s)
    ws = work / "ws"
    env = {**os.environ, "CXRFL_SITE_CONFIG": str(config), "HOME": str(work / "home")}
    nvflare = str(Path(sys.executable).with_name("nvflare"))
    log(f"nvflare simulator {job.name} -n 1 -t 1 ({s.rounds} rounds of {s.steps} steps)")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [nvflare, "simulator", str(job), "-w", str(ws), "-n", "1", "-t", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    sim_seconds = time.perf_counter() - t0
    records = ws / "server" / "simulate_job" / "app_server" / "cxrfl" / "rounds.jsonl"
    if not records.is_file():
        raise RuntimeError(
            f"the simulator left no round records (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    rates = [
        float(m["images_per_second"])
        for line in records.read_text().splitlines()
        for m in json.loads(line).get("site_metrics", {}).values()
        if m.get("images_per_second")
    ]
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


# ------------------------------------------------------------------ 3. payload
def payload_benchmark() -> dict[str, Any]:
    """Part 3: bytes per site per round for each head mode (two-hospitals label sets, full DenseNet121)."""
    from cxrfl.fl.wire import dumps, model_message
    from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, batchnorm_keys, build_model
    from cxrfl.surgical.head_modes import payload_for

    state = model_state()
    bn = set(batchnorm_keys(build_model(ModelConfig(image_size=224), 20)))
    union = sorted(set(NIH_CLASSES) | set(CHEXPERT_CLASSES))
    full_bytes = int(sum(v.nbytes for v in state.values()))
    body_bytes = int(sum(v.nbytes for k, v in state.items() if not k.startswith(HEAD_PREFIX)))
    row_bytes = int(state[HEAD_PREFIX + "weight"][0].nbytes + state[HEAD_PREFIX + "bias"][:1].nbytes)

    def wire(params: dict[str, Any], classes: list[str] | None) -> int:
        meta = {"classes": classes} if classes else {}
        return len(dumps(model_message(params, meta)))

    sites = {"hospital-a (NIH, 14)": list(NIH_CLASSES), "hospital-b (CheXpert, 13)": list(CHEXPERT_CLASSES)}
    modes = {
        "surgical": ("surgical", set()),
        "union (vanilla FL, partial loss)": ("union", set()),
        "local (personalized FL)": ("local", set()),
        "local + FedBN": ("local", bn),
    }
    out: dict[str, Any] = {
        "full_model_bytes": full_bytes,
        "feature_extractor_bytes": body_bytes,
        "head_row_bytes": row_bytes,
        "union_classes": len(union),
        "full_model_wire_bytes": wire(state, union),
        "sites": {},
    }
    for site, classes in sites.items():
        rows = {}
        for label, (mode, exclude) in modes.items():
            params, sent = payload_for(state, union, classes, head_mode=mode, exclude=exclude)
            raw = int(sum(v.nbytes for v in params.values()))
            rows[label] = {
                "raw_bytes": raw,
                "wire_bytes": wire(params, sent),
                "fraction_of_full_model": raw / full_bytes,
                "head_rows": int(params[HEAD_PREFIX + "weight"].shape[0]) if HEAD_PREFIX + "weight" in params else 0,
            }
        expected = body_bytes + len(classes) * row_bytes
        rows["surgical"]["equals_feature_extractor_plus_own_rows"] = rows["surgical"]["raw_bytes"] == expected
        out["sites"][site] = rows
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
            "command": prev.get("command"),
            "settings": prev.get("settings"),
            "machine": prev.get("machine"),
        }
        found[part] = (prev[part], source)
    return found


def _run_parts(
    s: SpeedSettings, parts: list[str], res: dict[str, Any], default_threads: int, log: Callable[[str], None]
) -> None:
    """Measure ``parts`` into ``res`` (the training loops at ``s.threads``, aggregation at torch's default)."""
    import torch

    if "simulator" in parts:
        with tempfile.TemporaryDirectory(prefix="cxrfl-speed-") as tmp:
            res["simulator"] = simulator_vs_plain(s, Path(tmp), log)
        log(f"simulator/plain = {res['simulator']['ratio']:.2f}")
    if "training" in parts:
        res["training"] = training_benchmark(s.training(), log)
        log(f"default/fp32 = {res['training']['ratio']:.2f}")
    if "aggregation" in parts:
        torch.set_num_threads(default_threads)
        res["aggregation"] = aggregation_benchmark(s.site_counts, s.repeats, busy=s.busy, log=log)
    if "payload" in parts:
        res["payload"] = payload_benchmark()
    if "accuracy" in parts:
        with tempfile.TemporaryDirectory(prefix="cxrfl-accuracy-") as tmp:
            res["accuracy"] = accuracy_benchmark(s.training(), Path(tmp), log)
    if "loading" in parts:
        with tempfile.TemporaryDirectory(prefix="cxrfl-loading-") as tmp:
            res["loading"] = loading_benchmark(s.loading, Path(tmp), log)


def json_summary(res: dict[str, Any], parts: Sequence[str]) -> dict[str, Any]:
    """The headline numbers of the parts measured in this run (what ``--json`` prints).

    Args:
        res: :func:`run_speed`'s result.
        parts: the parts measured.
    """
    out: dict[str, Any] = {}
    if "training" in parts:
        out["training"] = {
            k: res["training"][k]
            for k in (
                "fp32_img_s",
                "default_img_s",
                "ratio",
                "precision",
                "channels_last",
                "threads",
                "image_size",
                "batch_size",
                "device",
            )
        }
    if "aggregation" in parts:
        out["aggregation"] = aggregation_summary(res["aggregation"])
    if "accuracy" in parts:
        out["accuracy"] = {
            k: res["accuracy"][k]
            for k in (
                "fp32_mean_auroc",
                "default_mean_auroc",
                "difference",
                "difference_sd",
                "precision",
                "channels_last",
                "seeds",
                "epochs",
            )
        }
    if "simulator" in parts:
        out["simulator"] = {k: res["simulator"][k] for k in ("simulator_mean", "plain_mean", "ratio")}
    if "payload" in parts:
        out["payload"] = {"full_model_bytes": res["payload"]["full_model_bytes"]}
    if "loading" in parts:
        out["loading"] = loading_summary(res["loading"])
    return out


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
    parts = s.measured()
    earlier = _earlier_results(out / "speed.json", [p for p in PARTS if p not in parts])
    default_threads = torch.get_num_threads()
    res: dict[str, Any] = {
        "settings": asdict(s),
        "command": command_line(),
        "machine": machine(torch.device("cpu")),  # its torch_threads: the default, before the parts set theirs
    }
    _run_parts(s, parts, res, default_threads, log)
    for part, (value, source) in earlier.items():
        res[part] = value
        res.setdefault("carried_over", {})[part] = source
        log(f"{part}: carried over from the earlier run ({source['command']})")
    res["parts_measured"] = parts
    res["verdicts"] = speed_verdicts(res)
    (out / "speed.json").write_text(json.dumps(res, indent=1))
    (out / "speed.md").write_text(format_speed(res))
    log(f"wrote {out / 'speed.json'} and {out / 'speed.md'}")
    return res
