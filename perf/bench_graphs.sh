#!/usr/bin/env bash
# engine.cuda_graphs against eager launch on the CPU device, side by side in one run: the micro
# config on each path that captures (the fused model, the stage engine on 1 rank, tensor and
# pipeline parallelism on 2 ranks), alternating eager and graph runs. On the CPU a graph is a
# recorded call list, so the ratio is what replay saves of dt's own per-node work (dispatch,
# argument checks, tracing scopes); a GPU also saves the kernel launches (perf/bench_gpu.sh).
# Appends the table to perf/RESULTS.md.
#   perf/bench_graphs.sh [REPS] [STEPS]     (defaults 3 and 300; medians of the reps)
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
reps=${1:-3}
steps=${2:-300}
build=${DT_BUILD_DIR:-$DT_ROOT/build-release}
dt_build "$build" -DCMAKE_BUILD_TYPE=Release -DDT_BUILD_TESTS=OFF >/dev/null
dt_local_mpi_env
cores=$(nproc)  # before OMP_NUM_THREADS=1, which nproc reports instead
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
text=/usr/share/common-licenses/GPL-3

tps() {  # ranks [options]: steady-state tok/s of one run
  local ranks=$1
  shift
  local out
  out=$(mpiexec -n "$ranks" "$build/apps/dt_train" --config "$DT_ROOT/configs/micro.ini" \
    --data.path="$text" --train.steps="$steps" --train.eval-every=0 --train.log-every=1000000 \
    --train.micro-batch=2 "$@" 2>&1) || { printf '%s\n' "$out" >&2; return 1; }
  sed -nE 's/.*done: .* ([0-9.]+) tok\/s \(steady state\).*/\1/p' <<<"$out"
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

row() {  # name ranks [options]
  local name=$1 ranks=$2
  shift 2
  local e=() g=() r=()
  for _ in $(seq "$reps"); do
    e+=("$(tps "$ranks" "$@")")
    g+=("$(tps "$ranks" "$@" --engine.cuda_graphs=true)")
    r+=("$(awk -v a="${e[-1]}" -v b="${g[-1]}" 'BEGIN{printf "%.3f", b/a}')")
  done
  printf '| %s | %s | %.0f | %.0f | %.2fx (%s) |\n' "$name" "$ranks" \
    "$(printf '%s\n' "${e[@]}" | median)" "$(printf '%s\n' "${g[@]}" | median)" \
    "$(printf '%s\n' "${r[@]}" | median)" "$(printf '%s\n' "${r[@]}" | sort -g | paste -sd' ')"
}

table=$( {
  echo "| path | ranks | eager tok/s | graphs tok/s | graphs / eager, median (each round) |"
  echo "|---|---:|---:|---:|---:|"
  row "fused model" 1
  row "stage engine (parallel.engine=graph)" 1 --parallel.engine=graph
  row "tensor parallel (tp=2)" 2 --parallel.tp=2
  row "pipeline (pp=2, 4 micro-batches)" 2 --parallel.pp=2
} )
echo "$table"
{
  echo
  echo "## engine.cuda_graphs against eager launch on the CPU device, $(date -u +%F), $cores cores, load $(cut -d' ' -f1 /proc/loadavg)"
  echo
  echo "Command: \`perf/bench_graphs.sh $reps $steps\` (micro config, micro-batches of 2, $steps steps; eager and graph runs alternate; medians of $reps rounds)"
  echo
  echo "$table"
} >> "$DT_ROOT/perf/RESULTS.md"
