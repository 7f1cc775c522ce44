#!/usr/bin/env bash
# Runs the benchmarks of perf/ and appends their tables, with the command, to perf/RESULTS.md.
#   perf/run.sh [RANKS]      (default 2)
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
ranks=${1:-2}
build=${DT_BUILD_DIR:-$DT_ROOT/build}
dt_build "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
dt_local_mpi_env
cmd="mpiexec -n $ranks $build/perf/bench_comm 20"
out=$($cmd)
echo "$out"
{
  echo
  echo "## dt::Comm vs MPI, $ranks ranks, $(date -u +%Y-%m-%d) on $(nproc) cores ($(uname -n))"
  echo
  echo "Command: \`perf/run.sh $ranks\` (runs \`${cmd/$DT_ROOT\//}\`)"
  echo
  echo "$out"
} >> "$DT_ROOT/perf/RESULTS.md"
