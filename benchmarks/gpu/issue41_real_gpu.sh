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
# Wheels in .whl (benchmarks/gpu/README.md) are installed first where the machine lacks monai/pydicom
# (bench_run.sh, shared with the other GPU benchmark).
set -u
OUT=${OUT:-/tmp/real-gpu}
SEEDS=${SEEDS:-5}
JOBS=${JOBS:-8}
THREADS=${THREADS:-2}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-480}
DATA=${DATA:-.devdata/shared}
EXTRA=${EXTRA:-}
WORK=${WORK:-/tmp/real-gpu-work}
if [ ! -e ../shared/data ] && [ -d "$DATA/data" ]; then
  ln -sfn "$(cd "$DATA" && pwd)" ../shared
fi
. "$(dirname "$0")/bench_run.sh"
gpu_setup
# go on from the committed run store (a fresh GPU machine starts bare): only the runs not stored yet train
if [ ! -d "$WORK/out/runs" ] && [ -d benchmarks/results/compare/real/runs ]; then
  mkdir -p "$WORK/out" && cp -r benchmarks/results/compare/real/runs "$WORK/out/runs"
fi
ls -la ../shared/ >> "$OUT/env.txt" 2>&1
gpu_bench real "$BENCH_TIMEOUT" $PY -m cxrfl.cli bench compare --profile real \
  --site-config site_configs/nih1000.yaml --site-config site_configs/real/kermany_pediatric.yaml \
  --site-config site_configs/real/hannover_mhh_covid.yaml --device cuda --seeds "$SEEDS" --jobs "$JOBS" \
  --threads "$THREADS" --out "$WORK/out" $EXTRA
grep -E "stored \(|training [0-9]+ in|Error|error" "$OUT/bench.log" 2>/dev/null | tail -40
cat "$OUT/env.txt"
