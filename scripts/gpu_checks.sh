#!/usr/bin/env bash
# The checks only a CUDA GPU can make, as one script for a borrowed one-GPU node with no network
# (`run-recipe preflight` is the full check of an 8-GPU node). Writes into $OUT:
#   gpu_checks.tgz  every step's log, the run folders' records, the measured spec, the comparison
# Steps: environment; the CUDA-gated tests and a real-mode Float8 row on one GPU (run together:
# neither is timed); then `preflight --gpus 1` (the device measured into a spec, a one-device step
# predicted, run and compared), alone on the GPU. Each step has its own time limit, and the
# archive is rewritten after each, so a step cut short still leaves the others' results.
# Usage: OUT=DIR [WHEELS=DIR] [PREFLIGHT_S=300] [PREFLIGHT_ARGS=--layers 8] [SKIP_FUNCTIONAL=1] bash scripts/gpu_checks.sh
#   WHEELS: wheels of what the node's Python lacks (torchao, datasets ...), installed --no-deps.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder the results go to}
W=${WORK:-/tmp/gpu_checks}
rm -rf "$W" && mkdir -p "$W"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$W/inductor

save() {  # steps run side by side: each writes its own temporary archive, then renames it
  tar czf "$OUT/.gpu_checks.$BASHPID" -C "$W" --exclude=inductor --exclude='*.distcp' . 2>/dev/null
  mv "$OUT/.gpu_checks.$BASHPID" "$OUT/gpu_checks.tgz"
}
step() {  # step NAME LIMIT_S COMMAND...: run, log to $W/NAME.log, note rc and seconds
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)"
  timeout -k 10 "$limit" "$@" >"$W/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$W/summary.txt"
  tail -n 15 "$W/$name.log"
  save
}

{
  date -u +%FT%TZ
  git rev-parse HEAD 2>/dev/null || echo "commit: not a git checkout"
  nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)"
} >"$W/environment.txt" 2>&1
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$WHEELS"/*.whl >>"$W/environment.txt" 2>&1
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$W/environment.txt" 2>&1
"$PY" - >>"$W/environment.txt" 2>&1 <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
import torchao; print("torchao", torchao.__version__)
EOF
cat "$W/environment.txt"
save
RR="$PY -m recipes.cli"

# Functional checks, side by side (untimed): the CUDA-gated tests; a real-mode Float8 row on one
# GPU (8B's widths, 2 blocks, Llama 3's tokenizer, the offline corpus), saving at step 15, then
# resumed to step 25 from that checkpoint.
REAL=(llama3_8b/table1/8gpu_fsdp_compile_float8 --mode real --out "$W/real_float8"
  --set parallelism.dp_shard=1 --set parallelism.world_size=1 --set model.n_layers=2
  --set data.dataset=c4_offline --set data.path=assets/c4_offline --set metrics.log_freq=5
  --set checkpoint.enabled=true --set checkpoint.interval=15)
if [ -z "${SKIP_FUNCTIONAL:-}" ]; then
step cuda_tests 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_toggles.py::test_float8_on_cuda \
  tests/test_gpu_spec.py::test_measure_this_gpu &
(step real_row 120 $RR run "${REAL[@]}" --set training.steps=20 &&
  step real_resume 90 $RR run "${REAL[@]}" --set training.steps=25)
wait
fi

# Timed, alone on the GPU: measure, predict, run, compare.
step preflight_one "${PREFLIGHT_S:-300}" $RR preflight --gpus 1 --device cuda --rounds 1 --steps 4 --out "$W/preflight_one" ${PREFLIGHT_ARGS:-}
save
cat "$W/summary.txt"
