# Sourced by the GPU benchmark scripts (issue41_real_gpu.sh, issue42_fedfew_gpu.sh): what they share.
#   gpu_setup OUT WORK      wheels from .whl (where the machine lacks monai/pydicom), PYTHONPATH, env.txt, GPU samples
#   gpu_bench NAME SECONDS CMD...
#                           runs CMD (stdout and stderr to $OUT/bench.log) in its own session, stopped after SECONDS
#                           together with its worker processes; $WORK/out is packed into $OUT/NAME.tgz every 30 s and
#                           at the end (without model files), so a run stopped from outside loses at most that
# Needs OUT and WORK set; sets PY (python3 unless given).

gpu_setup() {
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
  # MPS=1: NVIDIA's multi-process service, so the runs side by side share the GPU at once instead of taking
  # turns (without it, 10 DenseNet121 runs at 64 px kept an H200 80-88 % busy at about 250 images/s each)
  if [ -n "${MPS:-}" ] && command -v nvidia-cuda-mps-control >/dev/null; then
    nvidia-cuda-mps-control -d && echo "MPS started" >> "$OUT/env.txt"
  fi
  SMI=
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -l 2 > "$OUT/gpu.csv" &
    SMI=$!
  fi
}

gpu_pack() {
  tar czf "$OUT/$1.tgz.part" -C "$WORK" --exclude=.work --exclude=.claims out 2>/dev/null \
    && mv "$OUT/$1.tgz.part" "$OUT/$1.tgz"
}

gpu_bench() {
  local name=$1 seconds=$2 start bench stopper packer
  shift 2
  (while sleep 30; do gpu_pack "$name"; done) &
  packer=$!
  start=$(date +%s)
  # its own session: the stop ends the benchmark and its spawned worker processes together (a plain
  # `timeout` would end the parent alone, and `pkill -f` does not match the workers' command lines)
  setsid "$@" > "$OUT/bench.log" 2>&1 &
  bench=$!
  (sleep "$seconds"; kill -TERM -- "-$bench" 2>/dev/null; sleep 10; kill -KILL -- "-$bench" 2>/dev/null) &
  stopper=$!
  wait "$bench"
  echo "bench rc $? seconds $(( $(date +%s) - start ))" >> "$OUT/env.txt"
  kill "$stopper" "$packer" 2>/dev/null
  kill -KILL -- "-$bench" 2>/dev/null
  [ -n "$SMI" ] && kill "$SMI" 2>/dev/null
  gpu_pack "$name"
  gzip -kf "$OUT/bench.log"
  if [ "$(stat -c %s "$OUT/bench.log")" -gt 15000000 ]; then rm -f "$OUT/bench.log"; fi
  ls -la "$OUT" >> "$OUT/env.txt"
}
