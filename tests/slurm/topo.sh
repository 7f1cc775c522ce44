#!/usr/bin/env bash
# slurm.topo: `sbatch -n 2 slurm/topo.sbatch` on the local cluster checks the fresh allocation:
# the job completes, dt_topo reports both ranks on the node, each bound by srun (--cpu-bind=cores,
# "launcher"), and every check passes. A DT_TOPO_CONFIG that does not exist fails the job, naming
# it.
source "$(dirname "$0")/lib.sh"
need_cluster
echo "=== T: sbatch -n 2 slurm/topo.sbatch --check.bandwidth-iters=2"
out=$(DT_PREFIX=$DT_ROOT sbatch --parsable -n 2 -o "$WORK/T.out" "$DT_ROOT/slurm/topo.sbatch" \
  --check.bandwidth-iters=2 2>&1) || fail "sbatch refused slurm/topo.sbatch: $out"
JOB=${out%%;*}
JOBS+=("$JOB")
expect_end T "$JOB" COMPLETED
expect_line T "^dt_topo: all checks passed on 2 ranks"
expect_line T "^0 +$NODE +0-1 "
expect_line T " 0:[0-9]+\(launcher\) 1:[0-9]+\(launcher\)$"
# A DT_TOPO_CONFIG that does not exist fails the job naming it (the default was taken instead).
echo "=== C: DT_TOPO_CONFIG=$WORK/missing-topo.ini sbatch -n 2 slurm/topo.sbatch"
out=$(DT_PREFIX=$DT_ROOT DT_TOPO_CONFIG=$WORK/missing-topo.ini sbatch --parsable -n 2 \
  -o "$WORK/C.out" "$DT_ROOT/slurm/topo.sbatch" 2>&1) || fail "sbatch refused slurm/topo.sbatch: $out"
JOB=${out%%;*}
JOBS+=("$JOB")
expect_end C "$JOB" FAILED
expect_line C "^dt-topo: error: config file '$WORK/missing-topo.ini' does not exist or is not readable \(DT_TOPO_CONFIG\)$"
expect_no_line C "^dt_topo"
node_healthy
finish
