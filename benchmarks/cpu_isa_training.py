"""Training throughput per precision and memory format, on this CPU and on this CPU limited to AVX2 (issue 44).

Issue 44 point 1 asks what ``precision: auto`` should pick on CPUs without native bfloat16. Where no such
machine is at hand, this emulates one: a child process runs with ``ATEN_CPU_CAPABILITY=avx2`` (PyTorch's own
kernels dispatch to AVX2) and ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's convolutions too), so neither AVX-512 nor
native bfloat16 is used; ``auto`` then resolves as on an AVX2-only CPU
(:func:`cxrfl.nn.precision.cpu_has_native_bf16`). It is an emulation: the cores, caches and memory stay this
machine's, so compare the settings within one ISA, and the ISAs by their ratio only.

Each ISA's child times DenseNet121 training steps (forward, backward, Adam; the demo's 64 px, batch 32) in
float32 NCHW, float32 channels-last and ``auto``, the settings taking turns (repeats alternate the order).

    .venv/bin/python benchmarks/cpu_isa_training.py --out benchmarks/results/speed/cpu_isa.json

Run it alone on the machine (no other torch process): two processes on 2 cores slow each other 5-20x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ISAS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"},
}
SETTINGS = {"fp32-nchw": ("fp32", False), "fp32-channels-last": ("fp32", True), "auto": ("auto", "auto")}


def child(steps: int, repeats: int, threads: int, image_size: int, batch_size: int) -> dict:
    """Images/s of each setting of :data:`SETTINGS` in this process (its ISA as the environment set it)."""
    import torch
    from cxrfl.bench.speed_training import TrainingSpeedSettings, synthetic_batches
    from cxrfl.nn.models import ModelConfig, build_model
    from cxrfl.nn.precision import cpu_has_native_bf16, resolve
    from cxrfl.nn.training import adam, train_epochs

    torch.set_num_threads(threads)
    batches = synthetic_batches(TrainingSpeedSettings(image_size=image_size, batch_size=batch_size, steps=steps), 14)
    runs = {}
    for name, (precision, channels_last) in SETTINGS.items():
        torch.manual_seed(0)
        model = build_model(ModelConfig(image_size=image_size), 14)
        opt = adam(model, 1e-3)
        compute = resolve(precision, channels_last, "cpu")
        train_epochs(model, batches[:2], opt, compute)  # kernels, allocator and formats warmed up
        runs[name] = (model, opt, compute)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            model, opt, compute = runs[name]
            rates[name].append(train_epochs(model, batches, opt, compute).images_per_second)
            print(f"  {name} ({compute.describe()}): {rates[name][-1]:.1f} images/s", file=sys.stderr, flush=True)
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": cpu_has_native_bf16(),
        "auto": runs["auto"][2].describe(),
        "images_per_second": {name: statistics.mean(v) for name, v in rates.items()},
        "repeats": rates,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/speed/cpu_isa.json"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = [str(a.steps), str(a.repeats), str(a.threads), str(a.image_size), str(a.batch_size)]
    if a.child:
        print(json.dumps(child(*map(int, sizes))))
        return
    import torch
    from cxrfl.bench.protocol import code_version, machine

    results = {
        "machine": machine(torch.device("cpu")),
        "code": code_version(),
        "settings": vars(a) | {"out": str(a.out)},
        "isas": {},
    }
    for isa, env in ISAS.items():
        print(f"{isa}: {env or 'this CPU as it is'}", file=sys.stderr, flush=True)
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "--steps",
                sizes[0],
                "--repeats",
                sizes[1],
                "--threads",
                sizes[2],
                "--image-size",
                sizes[3],
                "--batch-size",
                sizes[4],
            ],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        sys.stderr.write(done.stderr)
        results["isas"][isa] = {"environment": env, **json.loads(done.stdout.strip().splitlines()[-1])}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=2) + "\n")
    for isa, r in results["isas"].items():
        rates = r["images_per_second"]
        base = rates["fp32-nchw"]
        print(
            f"{isa} ({r['cpu_capability']}, native bf16 {r['native_bf16']}, auto = {r['auto']}): "
            + ", ".join(f"{n} {v:.1f} img/s ({v / base:.2f}x)" for n, v in rates.items())
        )


if __name__ == "__main__":
    main()
