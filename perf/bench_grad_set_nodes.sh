#!/usr/bin/env bash
# The gpt-tiny gradient set all-reduced per tensor (52 calls) against buckets, on one node (2 ranks,
# shared memory) and across two namespaced nodes (1 rank each, TCP over a veth bridge: the
# inter-node regime gradient buckets exist for), same backend, same run.
#   perf/bench_grad_set_nodes.sh [BUILD_DIR]      (root: the two-node part needs namespaces)
set -uo pipefail
build=${1:-${DT_BUILD_DIR:-$(dirname "$0")/../build}}
root=$(cd "$(dirname "$0")/.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
echo "load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
for b in 4 25; do
  args=(--grad-set="$root/configs/gpt-tiny.ini" --grad-set.bucket-mb="$b" --backends=mpi,shm
        --iters=20 --warmup=3)
  echo "== one node, 2 ranks, bucket $b MiB: mpiexec -n 2 dt_bench ${args[*]}"
  mpiexec -n 2 "$build/apps/dt_bench" "${args[@]}" | grep -E '^#? *(backend|mpi|shm) '
  echo "== two namespaced nodes x 1 rank, bucket $b MiB: tests/multinode/mpirun-nodes.sh 2 1 dt_bench ${args[*]}"
  "$root/tests/multinode/mpirun-nodes.sh" 2 1 "$build/apps/dt_bench" "${args[@]}" |
    grep -E '^#? *(backend|mpi|shm) '
done
