#!/usr/bin/env bash
# Sealed tensor traffic against its ceilings, side by side in one run:
#   1. openssl speed -elapsed -evp aes-256-gcm on one core (taskset -c 0), 1 MiB and 16 KiB
#      blocks (wall clock, as bench_seal measures: on a loaded machine both see the same load)
#   2. bench_seal under mpiexec -n 2: seal-only, sealed vs plain MPI point-to-point (1/4/16 MiB),
#      sealed vs unsealed all_reduce of 16 MiB
#   perf/bench_seal.sh [BUILD_DIR]     (default build/; builds the bench_seal target)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
cmake --build "$build" --target bench_seal -j "$(nproc)" >/dev/null
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
echo "== openssl speed -elapsed -evp aes-256-gcm (one core, wall clock like bench_seal)"
taskset -c 0 openssl speed -elapsed -evp aes-256-gcm -seconds 2 -bytes 1048576 2>/dev/null | tail -n 1
taskset -c 0 openssl speed -elapsed -evp aes-256-gcm -seconds 2 -bytes 16384 2>/dev/null | tail -n 1
echo "== bench_seal (mpiexec -n 2)"
mpiexec -n 2 "$build/tests/security/bench_seal" --iters 5
