#!/usr/bin/env bash
# Step-time overhead of the trace timeline: dt_train with --trace.dir against the same run
# without it, alternating in one session (2 ranks, one thread each), reported as the ratio of the
# median steady-state step times; plus the cost of one dt::trace::Scope with tracing off and on.
# Appends the table to perf/RESULTS.md.
#   perf/bench_trace.sh [REPS]     (default 5 alternating pairs per config)
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
reps=${1:-5}
dt_bench_build
corpus=$DT_ROOT/run/corpus.txt
"$DT_ROOT/scripts/corpus" "$corpus" >/dev/null
tdir=$(mktemp -d)
trap 'rm -rf "$tdir"' EXIT
cores=$(nproc)  # before OMP_NUM_THREADS=1, which nproc reports instead
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

ms_per_step() {  # config steps tokens-per-step [options]: steady-state ms per step of one run
  local config=$1 steps=$2 tokens=$3
  shift 3
  mpiexec -n 2 --bind-to core "$build/apps/dt_train" --config "$DT_ROOT/configs/$config.ini" \
    --data.path="$corpus" --train.steps="$steps" --train.eval-every=0 --train.eval-windows=2 \
    --train.log-every=1000000 --optim.warmup=2 "$@" |
    sed -nE 's/.*done: .* ([0-9.]+) tok\/s \(steady state\).*/\1/p' |
    awk -v n="$tokens" '{printf "%.4f", n / $1 * 1e3}'
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

row() {  # config steps tokens-per-step
  local config=$1 steps=$2 tokens=$3 off=() on=() events=""
  for _ in $(seq "$reps"); do
    off+=("$(ms_per_step "$config" "$steps" "$tokens")")
    rm -rf "$tdir/trace"
    on+=("$(ms_per_step "$config" "$steps" "$tokens" --trace.dir="$tdir/trace")")
    events=$(sed -nE 's/.*"events":([0-9]+).*/\1/p' "$tdir/trace/trace-rank0.json")
  done
  local mo mn
  mo=$(printf '%s\n' "${off[@]}" | median)
  mn=$(printf '%s\n' "${on[@]}" | median)
  printf '| %s | %s | %s | %s | %.3f | %s | off: %s; on: %s |\n' "$config" "$steps" "$mo" "$mn" \
    "$(awk -v a="$mn" -v b="$mo" 'BEGIN{print a/b}')" "$events" "${off[*]}" "${on[*]}"
}

table=$( {
  echo "| config | steps | ms/step, trace off (median) | ms/step, trace on (median) | on/off | events in rank 0's file | all reps |"
  echo "|---|---:|---:|---:|---:|---:|---|"
  row micro 300 256     # 8 x 32 tokens per step
  row gpt-tiny 12 2048  # 16 x 128
} )
scope=$("$build/perf/bench_trace" 200000)
read -r off_ns on_ns <<<"$scope"
echo "$table"
echo "one Scope: off $off_ns ns, on $on_ns ns"
{
  echo
  echo "## Trace timeline overhead, 2 ranks, $(date -u +%Y-%m-%d), $cores cores ($(uname -n))"
  echo
  echo "Command: \`perf/bench_trace.sh $reps\` ($reps alternating off/on runs per config; steady-state step time from dt_train's summary line; --trace.dir on the same disk)"
  echo
  echo "$table"
  echo
  echo "One dt::trace::Scope (constructor and destructor, \`perf/bench_trace 200000\`, best of 5 rounds): $off_ns ns with tracing off, $on_ns ns with tracing on."
} >> "$DT_ROOT/perf/RESULTS.md"
