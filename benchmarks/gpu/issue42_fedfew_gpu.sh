#!/usr/bin/env bash
# Issue 42's FedFew benchmark on one GPU, one command from the repository root:
#   `cxrfl bench fedfew --device cuda` with SEEDS seeds, JOBS of them side by side on the GPU (THREADS torch CPU
#   threads each), stopped after BENCH_TIMEOUT seconds; every finished (method, seed) is kept.
# What comes back: $OUT/fedfew.tgz (the run store, results.json, report.md, plots: unpack it into
# benchmarks/results/ and run `cxrfl bench fedfew` with the same settings to go on), the log, env.txt and the
# GPU's utilisation every 2 s. The tarball is refreshed every 30 s, so a run stopped from outside loses at most that.
# Wheels in .whl (benchmarks/gpu/README.md) are installed first where the machine lacks monai/pydicom
# (bench_run.sh, shared with the other GPU benchmark).
set -u
OUT=${OUT:-/tmp/fedfew-gpu}
SEEDS=${SEEDS:-8}
JOBS=${JOBS:-4}
THREADS=${THREADS:-2}
DEVICE=${DEVICE:-cuda}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-480}
METHODS=${METHODS:-fedfew,fedfew-scorer,fedfew-no-ebm,mlc,mlc-surgical,mlc-pooled,mlc-ssl,fedfew-balanced}
EXTRA=${EXTRA:-}
WORK=${WORK:-/tmp/fedfew-gpu-work}
. "$(dirname "$0")/bench_run.sh"
gpu_setup
gpu_bench fedfew "$BENCH_TIMEOUT" $PY -m cxrfl.cli bench fedfew --device "$DEVICE" --seeds "$SEEDS" \
  --jobs "$JOBS" --threads "$THREADS" --methods "$METHODS" --out "$WORK/out" --data-root "$WORK/data" $EXTRA
