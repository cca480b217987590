#!/usr/bin/env bash
# Side by side with torchtitan 0.3.0 on this CPU, alternating runs in one sitting.
#
#   scripts/bench_vs_torchtitan.sh PEER_VENV PEER_WORK [ROUNDS=3] [STEPS=12]
#
# PEER_VENV / PEER_WORK come from ../shared/bench/peer_torchtitan/setup.sh (its README). Both
# trainers run torchtitan's Llama 3 debug model shape (dim 256, 6 layers, 16 heads, 16 KV heads,
# vocab 2048), seq 512, local batch 8, bf16 params + fp32 reduce, no AC, no compile; ours on
# synthetic tokens. OMP threads: 2 for one process, 1 per rank for two. The figure is each
# trainer's mean tokens/s per rank over steps 3..STEPS (torchtitan's run.sh prints its own).
# Appends one row per run to results/peer_torchtitan.csv and prints the ratios.
# OURS_SET="--training.bf16_gemm=native" (say) adds overrides to our runs; they are named in the
# CSV's trainer column. On a CPU without AVX-512 our default bf16_gemm (auto) runs bf16 matmuls
# through the fp32 GEMM; torchtitan runs torch's bf16 kernel.
set -euo pipefail
PEER_VENV=${1:?PEER_VENV}; PEER_WORK=${2:?PEER_WORK}; ROUNDS=${3:-3}; STEPS=${4:-12}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEER_RUN="$ROOT/../shared/bench/peer_torchtitan/run.sh"
[ -x "$PEER_RUN" ] || { echo "no $PEER_RUN (../shared beside the checkout)" >&2; exit 2; }
CSV="$ROOT/results/peer_torchtitan.csv"
CPU=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
if grep -q amx_tile /proc/cpuinfo; then AMX=amx
elif grep -qw avx512f /proc/cpuinfo; then AMX=no-amx  # AVX-512
else AMX="no-amx/no-avx512"; fi
OURS_SET=${OURS_SET:-}
OURS_NAME="titan-recipes${OURS_SET:+ ($OURS_SET)}"
[ -f "$CSV" ] || echo "date,cpu,trainer,nproc,round,steps,tokens_per_s_per_rank" > "$CSV"

ours() {  # nproc -> mean tokens/s per rank over steps 3..STEPS
  local n=$1 out; out=$(mktemp -d)
  OMP_NUM_THREADS=$([ "$n" = 1 ] && echo 2 || echo 1) "$ROOT/.venv/bin/torchrun" --standalone \
    --nproc_per_node "$n" -m core.train --model.dim=256 --model.n_layers=6 --model.n_heads=16 \
    --model.n_kv_heads=16 --model.vocab_size=2048 --data.dataset=synthetic --training.seq_len=512 \
    --training.local_batch_size=8 --training.mixed_precision_param=bfloat16 \
    --training.mixed_precision_reduce=float32 --training.steps="$STEPS" --optimizer.lr=8e-4 \
    --metrics.progress=false --job.output_dir="$out" $OURS_SET > "$out.log" 2>&1 \
    || { tail -20 "$out.log" >&2; exit 1; }
  "$ROOT/.venv/bin/python" -c "
import json, statistics, sys
rows = [json.loads(line) for line in open('$out/metrics.jsonl')]
print(round(statistics.mean(r['tokens_per_sec_per_device'] for r in rows if 3 <= r['step'] <= $STEPS)))"
  rm -rf "$out" "$out.log"
}

peer() {
  OMP_NUM_THREADS=$([ "$1" = 1 ] && echo 2 || echo 1) "$PEER_RUN" "$PEER_VENV" "$PEER_WORK" "$1" "$STEPS" 2>&1 \
    | tail -n 1 | sed 's/.*: //'
}

cd "$ROOT"
for round in $(seq 1 "$ROUNDS"); do
  for n in 1 2; do
    a=$(ours "$n"); b=$(peer "$n")
    now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    echo "$now,$CPU ($AMX),$OURS_NAME,$n,$round,$STEPS,$a" >> "$CSV"
    echo "$now,$CPU ($AMX),torchtitan-0.3.0,$n,$round,$STEPS,$b" >> "$CSV"
    python3 -c "print(f'round $round, {$n} process(es): ours $a, torchtitan $b tokens/s/rank, ratio {$a / $b:.3f}')"
  done
done
