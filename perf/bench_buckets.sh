#!/usr/bin/env bash
# Gradient buckets overlapped with backward, measured where they matter: the training step.
#   perf/bench_buckets.sh [ROUNDS] [BUILD_DIR]
# Runs gpt-tiny data-parallel on 2 ranks, alternating in each round between
#   bucket-mb=25 (overlapped, the default), bucket-mb=0 (one all_reduce per tensor, overlapped),
#   bucket-mb=100000 (one bucket, started only when backward is over: no overlap),
# each on the shared-memory and on the MPI path, and prints the median steady-state step time
# (ms, from dt_train's final line) per variant and each variant's ratio to the no-overlap run.
set -euo pipefail
rounds=${1:-3}
build=${2:-${DT_BUILD_DIR:-$(dirname "$0")/../build}}
root=$(cd "$(dirname "$0")/.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
[ -f "$root/run/corpus.txt" ] || "$root/scripts/corpus" >/dev/null
variants=("25 shm" "0 shm" "100000 shm" "25 mpi" "0 mpi" "100000 mpi")
declare -A times
for ((r = 0; r < rounds; r++)); do
  for v in "${variants[@]}"; do
    set -- $v
    out=$(mpiexec -n 2 "$build/apps/dt_train" --config "$root/configs/gpt-tiny.ini" \
      --data.path="$root/run/corpus.txt" --train.steps=30 --train.eval-every=0 \
      --train.log-every=1000 --train.bucket-mb="$1" --comm.allreduce="$2" 2>&1)
    tok=$(echo "$out" | grep -oE '[0-9]+ tok/s \(steady state\)' | grep -oE '^[0-9]+')
    # step time from tokens/s: global batch 16 x 128 tokens
    ms=$(awk -v t="$tok" 'BEGIN { printf "%.1f", 16 * 128 / t * 1000 }')
    times["$v"]+="$ms "
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-22s %10s %s\n' "variant" "step ms" "all rounds"
for path in shm mpi; do
  base=$(echo "${times["100000 $path"]}" | median)
  for b in 25 0 100000; do
    m=$(echo "${times["$b $path"]}" | median)
    printf '%-22s %10s %-24s no-overlap/this = %s\n' "bucket-mb=$b $path" "$m" "${times["$b $path"]}" \
      "$(awk -v a="$base" -v b="$m" 'BEGIN { printf "%.2f", a / b }')"
  done
done
