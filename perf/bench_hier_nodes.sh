#!/usr/bin/env bash
# Hierarchical all-reduce against flat MPI_Allreduce across two real (namespaced) nodes.
#   perf/bench_hier_nodes.sh [BUILD_DIR] [ROUNDS]
# Starts a two-node cluster (scripts/slurm-local up --nodes 2, in DT_SLURM_DIR, default
# run/slurm-nodes of the checkout) unless it runs, and stops it again if it started it. One batch
# job, 2 nodes x 2 ranks, runs ROUNDS (default 3) times
#   srun --mpi=pmix dt_bench --ops=all_reduce --backends=mpi,shm --min-bytes=1M --max-bytes=64M
# mpi is dt::MpiComm (MPI_Allreduce over TCP between all 4 ranks), shm dt::ShmComm with its
# buffers in the arena: the hierarchical path (shared memory inside each node, MPI between the
# node leaders; path column "hier"). Both run one after the other at each size in the same run,
# so machine noise hits them alike. Prints per size and round the times and mpi/shm, then the
# median ratio per size. The two nodes share this machine's cores: the figures show what the
# hierarchy saves in inter-node traffic and rank count, not a real network.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-${DT_BUILD_DIR:-$root/build}}" && pwd)
rounds=${2:-3}
export DT_SLURM_DIR=${DT_SLURM_DIR:-$root/run/slurm-nodes}
sl=$root/scripts/slurm-local
started=""
if ! "$sl" status >/dev/null 2>&1; then
  "$sl" up --nodes 2 >/dev/null
  started=1
fi
trap '[ -z "$started" ] || "$sl" down >/dev/null' EXIT
eval "$("$sl" env)"
work=$(mktemp -d /tmp/dt-bench-hier.XXXXXX)
bench=("$build/apps/dt_bench" --ops=all_reduce --backends=mpi,shm --min-bytes=1M --max-bytes=64M
  --iters=5 --warmup=2)
cat >"$work/job.sh" <<JOB
#!/bin/bash
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for r in \$(seq $rounds); do
  srun --mpi=pmix ${bench[*]} | sed "s/^/round \$r: /"
done
JOB
echo "load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores; nodes: $("$sl" nodes | tr '\n' ' ')"
sbatch --wait -N 2 --ntasks-per-node=2 -o "$work/out" "$work/job.sh" >/dev/null || true
# Rows: round R: size count type redop root time algbw busbw #wrong backend path
python3 - "$work/out" <<'PY'
import statistics, sys
t, path = {}, {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 13 and f[0] == "round" and f[2].isdigit():
        r, size, us, backend = f[1].rstrip(":"), int(f[2]), float(f[7]), f[11]
        t.setdefault(size, {}).setdefault(r, {})[backend] = us
        path[size, backend] = f[12]
print(f"{'MiB':>5} {'round':>5} {'mpi us':>10} {'shm us':>10} {'mpi/shm':>8}")
for size in sorted(t):
    q = []
    for r, b in sorted(t[size].items()):
        if "mpi" in b and "shm" in b:
            q.append(b["mpi"] / b["shm"])
            print(f"{size / 2**20:>5g} {r:>5} {b['mpi']:>10.0f} {b['shm']:>10.0f} {q[-1]:>8.2f}")
    if q:
        print(f"{size / 2**20:>5g} median mpi/shm {statistics.median(q):.2f} (min {min(q):.2f}, "
              f"max {max(q):.2f}); shm path {path.get((size, 'shm'))}")
PY
grep -q "Out of bounds\|Avg bus bandwidth" "$work/out" || { cat "$work/out"; exit 1; }
echo "command: sbatch -N 2 --ntasks-per-node=2 (srun --mpi=pmix ${bench[*]#"$build/"}) x $rounds"
rm -rf "$work"
