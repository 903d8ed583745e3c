#!/usr/bin/env bash
# Issue 42's FedFew benchmark on one GPU, one command from the repository root:
#   `cxrfl bench fedfew --device cuda` with SEEDS seeds, JOBS of them side by side on the GPU (THREADS torch CPU
#   threads each), stopped after BENCH_TIMEOUT seconds; every finished (method, seed) is kept.
# What comes back: $OUT/fedfew.tgz (the run store, results.json, report.md, plots: unpack it into
# benchmarks/results/ and run `cxrfl bench fedfew` with the same settings to go on), the log, env.txt and the
# GPU's utilisation every 2 s. The tarball is refreshed every 30 s, so a run stopped from outside loses at most that.
# Wheels in .whl (benchmarks/gpu/README.md) are installed first where the machine lacks monai/pydicom.
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
mkdir -p "$OUT" "$WORK"
if [ -d .whl ] && [ -z "${SKIP_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/custom${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
{
  date -u; git rev-parse HEAD 2>/dev/null; nproc
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c "import torch, monai; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'capability', torch.backends.cpu.get_cpu_capability(), 'monai', monai.__version__)"
} > "$OUT/env.txt" 2>&1
SMI=
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -l 2 > "$OUT/gpu.csv" &
  SMI=$!
fi
pack() {
  tar czf "$OUT/fedfew.tgz.part" -C "$WORK" out 2>/dev/null && mv "$OUT/fedfew.tgz.part" "$OUT/fedfew.tgz"
}
(while sleep 30; do pack; done) &
PACKER=$!
start=$(date +%s)
# its own session: the stop below ends the benchmark and its spawned worker processes together (a plain
# `timeout` would end the parent alone, and `pkill -f` does not match the workers' command lines)
setsid $PY -m cxrfl.cli bench fedfew --device "$DEVICE" --seeds "$SEEDS" \
  --jobs "$JOBS" --threads "$THREADS" --methods "$METHODS" --out "$WORK/out" --data-root "$WORK/data" $EXTRA \
  > "$OUT/bench.log" 2>&1 &
BENCH=$!
(sleep "$BENCH_TIMEOUT"; kill -TERM -- "-$BENCH" 2>/dev/null; sleep 10; kill -KILL -- "-$BENCH" 2>/dev/null) &
STOPPER=$!
wait "$BENCH"
echo "bench rc $? seconds $(( $(date +%s) - start ))" >> "$OUT/env.txt"
kill "$STOPPER" 2>/dev/null
kill -KILL -- "-$BENCH" 2>/dev/null
kill "$PACKER" 2>/dev/null
[ -n "$SMI" ] && kill "$SMI" 2>/dev/null
pack
ls -la "$OUT" >> "$OUT/env.txt"
