#!/usr/bin/env bash
# All-reduce of dt's shared-memory communicator against Open MPI, measured side by side with
# dt_bench (2 ranks, one machine), plus sendrecv over MPI and UCX and the gpt-tiny gradient set
# per tensor against 25 MiB buckets. Every figure is the best of REPS runs; the spread of the
# runs is reported next to it. Appends a section to perf/RESULTS.md.
#   perf/bench_allreduce.sh [REPS]     (default 5)
# Environment: DT_BUILD_DIR (default build-release), DT_BUILD_TYPE (default Release),
# DT_RESULTS (default perf/RESULTS.md).
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
reps=${1:-5}
build=${DT_BUILD_DIR:-$DT_ROOT/build-release}
build_type=${DT_BUILD_TYPE:-Release}
results=${DT_RESULTS:-$DT_ROOT/perf/RESULTS.md}
cmake -S "$DT_ROOT" -B "$build" -DCMAKE_BUILD_TYPE="$build_type" >/dev/null
cmake --build "$build" -j "$(nproc)" --target dt_bench >/dev/null
dt_local_mpi_env
bench="$build/apps/dt_bench"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

ar_args="--ops=all_reduce --backends=mpi,shm,shm-copy --min-bytes=8 --max-bytes=64M --iters=20 --warmup=5"
sr_args="--ops=sendrecv --backends=mpi,ucx --min-bytes=8 --max-bytes=16M --step-factor=8 --iters=50 --warmup=5"
gs_args="--grad-set=configs/gpt-tiny.ini --backends=mpi,shm,shm-copy --iters=10 --warmup=2"
ar_cmd="mpiexec -n 2 apps/dt_bench $ar_args"
sr_cmd="mpiexec -n 2 apps/dt_bench $sr_args"
gs_cmd="mpiexec -n 2 apps/dt_bench $gs_args"

# Rows as "rep size backend time_us busbw path".
for r in $(seq "$reps"); do
  (cd "$DT_ROOT" && mpiexec -n 2 "$bench" $ar_args) |
    awk -v r="$r" '!/^#/ && NF >= 11 {print r, $1, $10, $6, $8, $11}' >>"$tmp/ar"
  (cd "$DT_ROOT" && mpiexec -n 2 "$bench" $sr_args) |
    awk -v r="$r" '!/^#/ && NF >= 11 {print r, $1, $10, $6, $8, $11}' >>"$tmp/sr"
  # "rep backend per_tensor_us bucketed_us"
  (cd "$DT_ROOT" && mpiexec -n 2 "$bench" $gs_args) |
    awk -v r="$r" '!/^#/ && NF >= 8 {print r, $1, $4, $5}' >>"$tmp/gs"
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# Best (lowest time) per size and backend: "size backend time busbw path all-busbw-values".
best() {
  awk '{k = $2 " " $3
        if (!(k in t) || $4 < t[k]) {t[k] = $4; b[k] = $5; p[k] = $6}
        all[k] = all[k] (all[k] == "" ? "" : " ") $5}
       END {for (k in t) print k, t[k], b[k], p[k], all[k]}' "$1" | sort -k1,1n -k2,2
}
best "$tmp/ar" >"$tmp/ar.best"
best "$tmp/sr" >"$tmp/sr.best"

big_table=$(awk '
  {t[$1 " " $2] = $3; b[$1 " " $2] = $4
   a = ""; for (i = 6; i <= NF; ++i) a = a (a == "" ? "" : " ") $i; all[$1 " " $2] = a}
  END {
    print "| size | mpi busbw GB/s | shm busbw GB/s | shm-copy busbw GB/s | shm/mpi | shm-copy/mpi | all runs (busbw mpi; shm; shm-copy) |"
    print "|---:|---:|---:|---:|---:|---:|---|"
    split("16777216 67108864", s, " ")
    for (j = 1; j <= 2; ++j) {
      z = s[j]; m = b[z " mpi"]; h = b[z " shm"]; c = b[z " shm-copy"]
      printf "| %d MiB | %.3f | %.3f | %.3f | %.2f | %.2f | %s; %s; %s |\n", z / 1048576, m, h, c,
             h / m, c / m, all[z " mpi"], all[z " shm"], all[z " shm-copy"]
    }
  }' "$tmp/ar.best")

full_table=$(awk '
  {t[$1 " " $2] = $3; b[$1 " " $2] = $4; p[$1 " " $2] = $5; sz[$1] = 1}
  END {
    print "| size (B) | mpi us | shm us | shm-copy us | mpi busbw | shm busbw | shm-copy busbw | shm/mpi (busbw) | shm path |"
    print "|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    n = 0; for (z in sz) keys[++n] = z + 0
    for (i = 1; i <= n; ++i) for (j = i + 1; j <= n; ++j) if (keys[j] < keys[i]) {x = keys[i]; keys[i] = keys[j]; keys[j] = x}
    for (i = 1; i <= n; ++i) {
      z = keys[i]
      printf "| %d | %.2f | %.2f | %.2f | %.3f | %.3f | %.3f | %.2f | %s |\n", z, t[z " mpi"],
             t[z " shm"], t[z " shm-copy"], b[z " mpi"], b[z " shm"], b[z " shm-copy"],
             t[z " mpi"] / t[z " shm"], p[z " shm"]
    }
  }' "$tmp/ar.best")

# Crossover: the smallest size from which shm (resp. shm-copy) is at least as fast as MPI at
# every larger size; reported with the latencies on both sides of it.
crossover() {  # backend
  awk -v be="$1" '
    {t[$1 " " $2] = $3; sz[$1] = 1}
    END {
      n = 0; for (z in sz) keys[++n] = z + 0
      for (i = 1; i <= n; ++i) for (j = i + 1; j <= n; ++j) if (keys[j] < keys[i]) {x = keys[i]; keys[i] = keys[j]; keys[j] = x}
      from = 0
      for (i = n; i >= 1; --i) { if (t[keys[i] " " be] <= t[keys[i] " mpi"]) from = i; else break }
      if (from == 0) { printf "%s is slower than MPI at the largest size (%d B)", be, keys[n]; exit }
      if (from == 1) { printf "%s is at least as fast as MPI at every size from %d B (%.2f us against %.2f us)", be, keys[1], t[keys[1] " " be], t[keys[1] " mpi"]; exit }
      lo = keys[from - 1]; hi = keys[from]
      slower = 0; for (i = 1; i < from; ++i) if (t[keys[i] " " be] > t[keys[i] " mpi"]) ++slower
      first = 0; for (i = 1; i <= n && t[keys[i] " " be] > t[keys[i] " mpi"]; ++i) first = i
      printf "%s is at least as fast as MPI from %d B up (%.2f us against MPI %.2f us); at %d B MPI is faster (%.2f us against %s %.2f us); below it MPI is faster at %d of %d sizes",
        be, hi, t[hi " " be], t[hi " mpi"], lo, t[lo " mpi"], be, t[lo " " be], slower, from - 1
      if (first > 0 && first + 1 < from)
        printf "; MPI is faster at every size up to %d B (%.2f us against %s %.2f us there), %s from %d B (%.2f us against MPI %.2f us)",
          keys[first], t[keys[first] " mpi"], be, t[keys[first] " " be], be, keys[first + 1], t[keys[first + 1] " " be], t[keys[first + 1] " mpi"]
    }' "$tmp/ar.best"
}
cross_shm=$(crossover shm)
cross_copy=$(crossover shm-copy)

sr_table=$(awk '
  {t[$1 " " $2] = $3; b[$1 " " $2] = $4; sz[$1] = 1}
  END {
    print "| size (B) | mpi us | ucx us | mpi GB/s | ucx GB/s | ucx/mpi (bw) |"
    print "|---:|---:|---:|---:|---:|---:|"
    n = 0; for (z in sz) keys[++n] = z + 0
    for (i = 1; i <= n; ++i) for (j = i + 1; j <= n; ++j) if (keys[j] < keys[i]) {x = keys[i]; keys[i] = keys[j]; keys[j] = x}
    for (i = 1; i <= n; ++i) {
      z = keys[i]
      printf "| %d | %.2f | %.2f | %.3f | %.3f | %.2f |\n", z, t[z " mpi"], t[z " ucx"],
             b[z " mpi"], b[z " ucx"], t[z " mpi"] / t[z " ucx"]
    }
  }' "$tmp/sr.best")

gs_table=$(awk '
  {if (!($2 in p) || $3 < p[$2]) p[$2] = $3
   if (!($2 in q) || $4 < q[$2]) q[$2] = $4
   ap[$2] = ap[$2] (ap[$2] == "" ? "" : " ") $3; aq[$2] = aq[$2] (aq[$2] == "" ? "" : " ") $4}
  END {
    print "| backend | one call per tensor (52 calls) us | 25 MiB buckets us | per-tensor / bucketed | all runs (per-tensor; bucketed) |"
    print "|---|---:|---:|---:|---|"
    split("mpi shm shm-copy", bs, " ")
    for (i = 1; i <= 3; ++i) { k = bs[i]; if (k in p) printf "| %s | %.0f | %.0f | %.2f | %s; %s |\n", k, p[k], q[k], p[k] / q[k], ap[k], aq[k] }
    if (("mpi" in p) && ("shm" in q)) printf "\nMPI per tensor against shm in buckets (what dt gains from both): %.2fx\n", p["mpi"] / q["shm"]
  }' "$tmp/gs")

report=$(
  echo "## All-reduce: shared memory vs Open MPI, 2 ranks, $(date -u +%Y-%m-%d), $(nproc) cores ($(uname -n))"
  echo
  echo "Command: \`perf/bench_allreduce.sh $reps\` (from the repository root, $build_type build, best of $reps runs of each):"
  echo
  echo "    $ar_cmd"
  echo "    $sr_cmd"
  echo "    $gs_cmd"
  echo
  echo "Backends of one run, per size one after the other: mpi = dt::MpiComm (MPI_Allreduce), shm = dt::ShmComm with the buffer in its arena (how dt's gradient buckets use it), shm-copy = dt::ShmComm with an ordinary buffer (through the staging area). busbw = algbw x 2(n-1)/n as in nccl-tests. Load average before/after: $load_before / $load_after."
  echo
  echo "$big_table"
  echo
  echo "Crossover (what \`--comm.shm-min-bytes\` / ShmConfig::min_bytes could be set to): $cross_shm."
  echo
  echo "With user buffers: $cross_copy."
  echo
  echo "<details><summary>Every size (best of $reps)</summary>"
  echo
  echo "$full_table"
  echo
  echo "</details>"
  echo
  echo "Send/receive ring (each rank sends to the next and receives from the previous), MPI against UCX (dt::UcxP2p), best of $reps:"
  echo
  echo "$sr_table"
  echo
  echo "Gradient set of gpt-tiny (dt::gpt_params of configs/gpt-tiny.ini, f32), all-reduced as one call per tensor in reverse parameter order against 25 MiB buckets (contiguous ranges of the flat gradient buffer in reverse parameter order), best of $reps:"
  echo
  echo "$gs_table"
)
echo "$report"
printf '\n%s\n' "$report" >>"$results"
