#!/usr/bin/env bash
# Issue 46's GPU check, one command on a GPU machine, from the repository root:
#   1. jobs/surgical_agg_gpu through NVFlare's simulator (two demo sites, the job's own settings
#      except ROUNDS rounds), GPU utilisation sampled every 0.5 s by nvidia-smi;
#   2. `cxrfl bench speed --only loading` (the loader per worker count against the model's own
#      training images/s from in-memory tensors: the upper bound).
#   THREADS=1 runs the two sites one after the other (each has the GPU alone), 2 side by side.
# Results under $OUT (default /tmp/gpucheck). Wheels in .whl (see benchmarks/gpu/README.md) are
# installed first where the machine lacks nvflare/monai/pydicom.
set -u
OUT=${OUT:-/tmp/gpucheck}
ROUNDS=${ROUNDS:-5}
WARMUP=${WARMUP:-}
IMAGE_SIZE=${IMAGE_SIZE:-}
JOB_TIMEOUT=${JOB_TIMEOUT:-300}
LOADING_TIMEOUT=${LOADING_TIMEOUT:-200}
mkdir -p "$OUT"
if [ -d .whl ] && [ -z "${SKIP_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/custom${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CXRFL_DEMO_DIR=${CXRFL_DEMO_DIR:-/tmp/cxrfl-demo}
PY=${PY:-python3}
{
  date -u; git rev-parse HEAD 2>/dev/null; nproc
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c "import torch, nvflare, monai; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'nvflare', nvflare.__version__, 'monai', monai.__version__)"
} > "$OUT/env.txt" 2>&1
rm -rf /tmp/gpucheck-job /tmp/gpucheck-ws && cp -r jobs/surgical_agg_gpu /tmp/gpucheck-job
$PY - "$ROUNDS" "$WARMUP" "$IMAGE_SIZE" <<'PYEOF'
import json, sys
p = "/tmp/gpucheck-job/app/config/config_fed_server.json"
c = json.load(open(p))
args = c["workflows"][0]["args"]
args["num_rounds"] = int(sys.argv[1])
if sys.argv[2]:
    args["train_config"]["warmup_epochs"] = int(sys.argv[2])
if sys.argv[3]:
    args["model_config"]["image_size"] = int(sys.argv[3])
json.dump(c, open(p, "w"), indent=1)
print("job settings:", json.dumps({k: args[k] for k in ("num_rounds", "model_config", "train_config")}))
PYEOF
SMI=
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,utilization.memory,memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_job.csv" &
  SMI=$!
fi
start=$(date +%s)
timeout "$JOB_TIMEOUT" $PY -m nvflare.cli simulator /tmp/gpucheck-job -w /tmp/gpucheck-ws -n 2 -t "${THREADS:-2}" > "$OUT/job.log" 2>&1
echo "job rc $? seconds $(( $(date +%s) - start ))" >> "$OUT/env.txt"
[ -n "$SMI" ] && kill "$SMI"
grep -h -E "img/s|images/s|round [0-9]+|warm-up|loader worker|training and evaluating|failed|Error" "$OUT/job.log" | cut -c1-400 > "$OUT/job_lines.txt"
if [ -n "$SMI" ]; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,utilization.memory,memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_loading.csv" &
  SMI=$!
fi
start=$(date +%s)
timeout "$LOADING_TIMEOUT" $PY -m cxrfl.cli bench speed --only loading --out /tmp/gpucheck-speed \
  --loading-images "${LOADING_IMAGES:-256}" --loading-workers "${LOADING_WORKERS:-0,2,4,8,15}" > "$OUT/loading.log" 2>&1
echo "loading rc $? seconds $(( $(date +%s) - start ))" >> "$OUT/env.txt"
[ -n "$SMI" ] && kill "$SMI"
cp /tmp/gpucheck-speed/speed.json "$OUT/" 2>/dev/null

gzip -f "$OUT/job.log"
ls -la "$OUT"; cat "$OUT/env.txt"; tail -5 "$OUT/loading.log"; tail -30 "$OUT/job_lines.txt"
