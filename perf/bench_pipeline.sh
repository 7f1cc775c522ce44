#!/usr/bin/env bash
# Pipeline bubble of the 1F1B schedule, measured against the theory (p-1)/(m+p-1).
#   perf/bench_pipeline.sh [BUILD_DIR]
# Runs a 4-layer GPT (gpt-tiny, global batch 16) with pp = 2 on 2 ranks and pp = 4 on 4 ranks, for
# several micro-batch counts m, and reads dt_train's own measurement: the share of the schedule
# each stage spends blocked on pipeline messages (step 1 onwards; the first step pays for page
# faults), averaged over the stages. Theory assumes equal stage times and free messages; the
# measured figure also holds the stage imbalance of the cut and the message time. With more ranks
# than cores (pp = 4 here), waiting ranks yield the core (mpi_yield_when_idle) but still share it.
set -euo pipefail
build=${1:-${DT_BUILD_DIR:-$(dirname "$0")/../build}}
root=$(cd "$(dirname "$0")/.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_mpi_yield_when_idle=1
[ -f "$root/run/corpus.txt" ] || "$root/scripts/corpus" >/dev/null
echo "load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
printf '%-4s %-4s %-12s %-12s %s\n' p m measured theory "per stage"
for pm in "2 2" "2 4" "2 8" "2 16" "4 4" "4 8" "4 16"; do
  set -- $pm
  cmd=(mpiexec -n "$1" "$build/apps/dt_train" --config "$root/configs/gpt-tiny.ini"
       --data.path="$root/run/corpus.txt" --train.steps=6 --train.eval-every=0
       --train.eval-windows=2 --train.log-every=1000 --parallel.pp="$1"
       --parallel.microbatches="$2")
  line=$("${cmd[@]}" 2>&1 | grep 'pipeline bubble:')
  meas=$(echo "$line" | sed -E 's/.*bubble: ([0-9.]+%).*/\1/')
  theory=$(echo "$line" | sed -E 's/.*= ([0-9.]+%) for.*/\1/')
  per=$(echo "$line" | sed -E 's/.*\);(.*)/\1/')
  printf '%-4s %-4s %-12s %-12s %s\n' "$1" "$2" "$meas" "$theory" "$per"
done
echo "command: ${cmd[*]} (p and m varied)"
