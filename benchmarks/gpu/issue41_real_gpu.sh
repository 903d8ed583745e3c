#!/usr/bin/env bash
# Issue 41's real federation on one GPU, one command from the repository root:
#   `cxrfl bench compare --profile real` over the three real sites (site_configs/nih1000.yaml,
#   site_configs/real/kermany_pediatric.yaml, site_configs/real/hannover_mhh_covid.yaml), SEEDS seeds, JOBS runs
#   side by side on the GPU (THREADS torch CPU threads each), stopped after BENCH_TIMEOUT seconds; every finished
#   (method, seed) is kept, seed by seed.
# The site configs read ../shared/data beside the checkout. Where that is absent (a GPU machine gets the checkout
# alone), DATA (default .devdata/shared, an excluded folder carried along) is linked there: a copy of the shared
# data with Kermany shrunk to 64 px by benchmarks/gpu/shrink_images.py (the originals exceed the carry limit).
# What comes back: $OUT/real.tgz (the run store, without model files: unpack it into benchmarks/results/ and run
# the same `cxrfl bench compare` to go on or to report), the log, env.txt and the GPU's utilisation every 2 s.
# The tarball is refreshed every 30 s, so a run stopped from outside loses at most that.
# Wheels in .whl (benchmarks/gpu/README.md) are installed first where the machine lacks monai/pydicom.
set -u
OUT=${OUT:-/tmp/real-gpu}
SEEDS=${SEEDS:-5}
JOBS=${JOBS:-8}
THREADS=${THREADS:-2}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-480}
DATA=${DATA:-.devdata/shared}
EXTRA=${EXTRA:-}
WORK=${WORK:-/tmp/real-gpu-work}
mkdir -p "$OUT" "$WORK"
if [ -d .whl ] && [ -z "${SKIP_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
if [ ! -e ../shared/data ] && [ -d "$DATA/data" ]; then
  ln -sfn "$(cd "$DATA" && pwd)" ../shared
fi
export PYTHONPATH="$PWD/custom${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
{
  date -u; git rev-parse HEAD 2>/dev/null; nproc
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c "import torch, monai; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'capability', torch.backends.cpu.get_cpu_capability(), 'monai', monai.__version__)"
  ls -la ../shared/ 2>&1
} > "$OUT/env.txt" 2>&1
SMI=
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -l 2 > "$OUT/gpu.csv" &
  SMI=$!
fi
pack() {
  tar czf "$OUT/real.tgz.part" -C "$WORK" --exclude=.work --exclude=.claims out 2>/dev/null \
    && mv "$OUT/real.tgz.part" "$OUT/real.tgz"
}
(while sleep 30; do pack; done) &
PACKER=$!
start=$(date +%s)
# its own session: the stop below ends the benchmark and its spawned worker processes together (a plain
# `timeout` would end the parent alone, and `pkill -f` does not match the workers' command lines)
setsid $PY -m cxrfl.cli bench compare --profile real \
  --site-config site_configs/nih1000.yaml --site-config site_configs/real/kermany_pediatric.yaml \
  --site-config site_configs/real/hannover_mhh_covid.yaml --device cuda --seeds "$SEEDS" --jobs "$JOBS" \
  --threads "$THREADS" --out "$WORK/out" $EXTRA > "$OUT/bench.log" 2>&1 &
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
gzip -kf "$OUT/bench.log"
[ "$(stat -c %s "$OUT/bench.log")" -gt 15000000 ] && rm -f "$OUT/bench.log"
ls -la "$OUT" >> "$OUT/env.txt"
grep -E "stored \(|training [0-9]+ in|Error|error" "$OUT/bench.log" 2>/dev/null | tail -40
cat "$OUT/env.txt"
