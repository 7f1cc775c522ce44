#!/usr/bin/env bash
# Pairs of dt_train runs on the CPU device that differ in one option, side by side in one run
# (the two runs of a pair alternate; medians over the rounds), as ratios of steady-state tokens/s:
#   - engine.cuda_graphs against eager launch, on each path that captures (the fused model, the
#     stage engine on 1 rank, tensor and pipeline parallelism on 2 ranks), micro config. On the
#     CPU a graph is a recorded call list, so the ratio is what replay saves of dt's own per-node
#     work (dispatch, argument checks, tracing scopes); a GPU also saves the kernel launches
#     (perf/bench_gpu.sh).
#   - bf16 matrix products reading the weights' 16-bit copy against casting the weights for every
#     product (test.cast-weights), micro and gpt-tiny configs.
#   - the drain vote at every micro-batch boundary (train.drain-within-step) against none, on 2
#     data-parallel ranks with micro-batches of one sequence: 32 a step of the micro config (32
#     tokens each, its most frequent use), 8 of gpt-tiny (128 tokens each); and on 2 pipeline
#     stages (a non-blocking vote read 2 micro-batches after it is taken), 32 a step of micro.
# Appends the table to perf/RESULTS.md.
#   perf/bench_pairs.sh [REPS] [STEPS]     (defaults 3 and 300: the micro config's run length)
# DT_PAIRS=REGEX runs only the pairs whose name matches REGEX (grep -E).
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
reps=${1:-3}
steps=${2:-300}
dt_bench_build
cores=$(nproc)  # before OMP_NUM_THREADS=1, which nproc reports instead
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
text=/usr/share/common-licenses/GPL-3

tps() {  # ranks config steps [options]: steady-state tok/s of one run
  local ranks=$1 config=$2 n=$3
  shift 3
  local out
  out=$(mpiexec -n "$ranks" "$build/apps/dt_train" --config "$DT_ROOT/configs/$config.ini" \
    --data.path="$text" --train.steps="$n" --train.eval-every=0 --train.log-every=1000000 \
    --train.eval-windows=2 "$@" 2>&1) || { printf '%s\n' "$out" >&2; return 1; }
  sed -nE 's/.*done: .* ([0-9.]+) tok\/s \(steady state\).*/\1/p' <<<"$out"
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

row() {  # name ranks config steps "A options" "B options" [common options]
  local name=$1 ranks=$2 config=$3 n=$4 a=$5 b=$6
  shift 6
  grep -Eq -- "${DT_PAIRS:-.}" <<<"$name" || return 0
  local ta=() tb=() r=()
  for _ in $(seq "$reps"); do
    # shellcheck disable=SC2086  # the A and B options are word lists
    ta+=("$(tps "$ranks" "$config" "$n" "$@" $a)")
    # shellcheck disable=SC2086
    tb+=("$(tps "$ranks" "$config" "$n" "$@" $b)")
    r+=("$(awk -v x="${ta[-1]}" -v y="${tb[-1]}" 'BEGIN{printf "%.3f", y/x}')")
  done
  printf '| %s | %s | %.0f | %.0f | %.2fx (%s) |\n' "$name" "$ranks" \
    "$(printf '%s\n' "${ta[@]}" | median)" "$(printf '%s\n' "${tb[@]}" | median)" \
    "$(printf '%s\n' "${r[@]}" | median)" "$(printf '%s\n' "${r[@]}" | sort -g | paste -sd' ')"
}

g="--engine.cuda_graphs=false --engine.cuda_graphs=true"
w="--test.cast-weights=true --test.cast-weights=false"
d="--train.drain-within-step=false --train.drain-within-step=true"
mb=--train.micro-batch=2
table=$( {
  echo "| pair: A against B | ranks | A tok/s | B tok/s | B / A, median (each round) |"
  echo "|---|---:|---:|---:|---:|"
  row "eager / graphs: fused model, micro" 1 micro "$steps" ${g% *} ${g#* } $mb
  row "eager / graphs: stage engine (parallel.engine=graph), micro" 1 micro "$steps" ${g% *} ${g#* } $mb --parallel.engine=graph
  row "eager / graphs: tensor parallel (tp=2), micro" 2 micro "$steps" ${g% *} ${g#* } $mb --parallel.tp=2
  row "eager / graphs: pipeline (pp=2, 4 micro-batches), micro" 2 micro "$steps" ${g% *} ${g#* } $mb --parallel.pp=2
  row "bf16 weights cast per product / 16-bit copy: fused model, micro" 1 micro "$steps" ${w% *} ${w#* } $mb --train.dtype=bf16
  row "bf16 weights cast per product / 16-bit copy: tensor parallel (tp=2), micro" 2 micro "$steps" ${w% *} ${w#* } $mb --train.dtype=bf16 --parallel.tp=2
  row "bf16 weights cast per product / 16-bit copy: fused model, gpt-tiny" 1 gpt-tiny $((steps / 200 + 5)) ${w% *} ${w#* } --train.dtype=bf16
  row "no drain vote / a vote at every micro-batch boundary: data parallel (dp=2), micro, 32 micro-batches of 1" 2 micro "$((steps / 8 + 1))" ${d% *} ${d#* } --train.batch=64 --train.micro-batch=1
  row "no drain vote / a vote at every micro-batch boundary: data parallel (dp=2), gpt-tiny, 8 micro-batches of 1" 2 gpt-tiny $((steps / 200 + 5)) ${d% *} ${d#* } --train.micro-batch=1
  row "no drain vote / a vote before each forward pass but the first and last 2, read 2 later: pipeline (pp=2), micro, 32 micro-batches of 1" 2 micro "$((steps / 8 + 1))" ${d% *} ${d#* } --train.batch=32 --train.micro-batch=1 --parallel.pp=2
} )
echo "$table"
{
  echo
  echo "## Option pairs of dt_train on the CPU device, $(date -u +%F), $cores cores, load $(cut -d' ' -f1 /proc/loadavg)"
  echo
  echo "Command: \`${DT_PAIRS:+DT_PAIRS='$DT_PAIRS' }perf/bench_pairs.sh $reps $steps\` (micro config: micro-batches of 2, $steps steps; gpt-tiny: $((steps / 200 + 5)) steps; the drain vote rows: micro-batches of 1, micro $((steps / 8 + 1)) steps of batch 64 (pp=2: 32); the runs of a pair alternate; medians of $reps rounds)"
  echo
  echo "$table"
} >> "$DT_ROOT/perf/RESULTS.md"
