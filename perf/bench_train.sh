#!/usr/bin/env bash
# dt_train against the same model in PyTorch, side by side in one run, one thread per rank, and
# dt on 2 ranks against 1 rank (same global batch). Appends the table to perf/RESULTS.md.
#   perf/bench_train.sh [REPS]     (default 3; the median of the reps is reported)
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
reps=${1:-3}
dt_bench_build
corpus=$DT_ROOT/run/corpus.txt
"$DT_ROOT/scripts/corpus" "$corpus" >/dev/null
py=/usr/bin/python3
$py -c "import torch" 2>/dev/null || { echo "bench_train: PyTorch missing: scripts/bootstrap --all" >&2; exit 1; }
cores=$(nproc)  # before OMP_NUM_THREADS=1, which nproc reports instead
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

dt_tps() {  # ranks config steps batch [options]
  local ranks=$1 config=$2 steps=$3 batch=$4
  shift 4
  mpiexec -n "$ranks" --bind-to core "$build/apps/dt_train" --config "$DT_ROOT/configs/$config.ini" \
    --data.path="$corpus" --train.steps="$steps" --train.batch="$batch" --train.eval-every=0 \
    --train.eval-windows=2 --train.log-every=1000000 --optim.warmup=2 "$@" |
    sed -nE 's/.*done: .* ([0-9.]+) tok\/s \(steady state\).*/\1/p'
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

row() {  # name config layers heads embd seq batch steps
  local name=$1 config=$2 L=$3 H=$4 E=$5 T=$6 B=$7 steps=$8
  local d1=() d2=() pt=()
  for _ in $(seq "$reps"); do
    d1+=("$(dt_tps 1 "$config" "$steps" "$B")")
    pt+=("$($py "$DT_ROOT/perf/torch_gpt.py" --layers "$L" --heads "$H" --embd "$E" --seq "$T" \
            --batch "$B" --steps "$steps" | awk '{print $3}')")
    d2+=("$(dt_tps 2 "$config" "$steps" "$B")")
  done
  local m1 m2 mp
  m1=$(printf '%s\n' "${d1[@]}" | median)
  m2=$(printf '%s\n' "${d2[@]}" | median)
  mp=$(printf '%s\n' "${pt[@]}" | median)
  # model FLOP/s of 1 rank: 6N + 12 L E T per token (N without position embeddings)
  local n=$(( 256 * E + L * (12 * E * E + 13 * E) + 2 * E ))
  local gf
  gf=$(awk -v t="$m1" -v n="$n" -v L="$L" -v E="$E" -v T="$T" 'BEGIN {printf "%.1f", t * (6 * n + 12 * L * E * T) / 1e9}')
  printf '| %s | %s | %.0f | %.0f | %.2f | %.0f | %.2f | %s |\n' "$name" "$B x $T" "$m1" "$mp" \
    "$(awk -v a="$m1" -v b="$mp" 'BEGIN{print a/b}')" "$m2" "$(awk -v a="$m2" -v b="$m1" 'BEGIN{print a/b}')" "$gf"
}

table=$( {
  echo "| config | batch x seq | dt 1 rank tok/s | PyTorch 1 thread tok/s | dt/PyTorch | dt 2 ranks tok/s | 2 ranks / 1 rank | dt model GFLOP/s (1 rank) |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|"
  row gpt-tiny gpt-tiny 4 4 256 128 16 16
  row micro micro 2 2 32 32 8 300
} )
sgemm=$("$build/perf/bench_sgemm" 1024 5)
echo "$table"
echo "sgemm 1 thread: $sgemm GFLOP/s"
{
  echo
  echo "## dt_train vs PyTorch $($py -c 'import torch; print(torch.__version__)'), $(date -u +%Y-%m-%d), $cores cores ($(uname -n))"
  echo
  echo "Command: \`perf/bench_train.sh $reps\` (median of $reps alternating runs; one thread per rank; same model, batch, AdamW and clipping)"
  echo
  echo "$table"
  echo
  echo "One-thread OpenBLAS sgemm 1024^3 in the same run: $sgemm GFLOP/s (the ceiling of the model FLOP/s column)."
} >> "$DT_ROOT/perf/RESULTS.md"
