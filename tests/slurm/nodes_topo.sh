#!/usr/bin/env bash
# slurm.nodes.topo: `sbatch -N 2 --ntasks-per-node=2 slurm/topo.sbatch` on two namespaced nodes:
# dt_topo reports two nodes (by their own hostnames) with two ranks each, every check passes and
# the neighbour pairs that cross the nodes are measured; then a test-only corrupted result on
# rank 3 (second node) fails the job naming that rank and the pair 3->0 with its hosts; and plain
# mpirun enters the same nodes through the rsh agent of scripts/slurm-local.
source "$(dirname "$0")/lib.sh"
source "$DT_ROOT/tests/slurm/nodes_lib.sh"
need_nodes 2

export DT_PREFIX=$DT_ROOT
job_script T "$DT_ROOT/slurm/topo.sbatch" -N 2 --ntasks-per-node=2 -- --check.bandwidth-iters=2
[ "$JOB_END" = COMPLETED ] || fail "T: job $JOB ended $JOB_END, expected COMPLETED"
expect_line T "^dt_topo: 4 ranks on 2 nodes \\(placement from pmix\\)"
expect_line T "^0 +$N1 +0-1 "
expect_line T "^1 +$N2 +2-3 "
expect_line T "^1->2 +$N1 -> $N2 .* ok$"
expect_line T "^3->0 +$N2 -> $N1 .* ok$"
expect_line T "^dt_topo: all checks passed on 4 ranks"

job_script C "$DT_ROOT/slurm/topo.sbatch" -N 2 --ntasks-per-node=2 -- --check.bandwidth-iters=1 \
  --test.corrupt-rank=3
[ "$JOB_END" = FAILED ] || fail "C: job $JOB ended $JOB_END, expected FAILED"
expect_line C "failing ranks: 3$"
expect_line C "^3->0 +$N2 -> $N1 .* WRONG$"
expect_line C "^dt_topo: FAILED: pair 3->0: "
# The same nodes without Slurm: plain mpirun with the rsh agent of scripts/slurm-local.
subnet=$("$DT_ROOT/scripts/slurm-local" subnet)
echo "=== M: mpirun --host $N1:2,$N2:2 (rsh agent, TCP on $subnet) dt_topo"
timeout -k 10 120 "${MPIEXEC[@]}" --host "$N1:2,$N2:2" -n 4 \
  --mca plm_rsh_agent "$("$DT_ROOT/scripts/slurm-local" agent)" \
  --mca oob_tcp_if_include "$subnet" --mca btl_tcp_if_include "$subnet" \
  "$BIN_DIR/dt_topo" --check.bandwidth-iters=1 >M.out 2>&1
rc=$?
sed 's/^/    /' M.out
[ "$rc" -eq 0 ] || fail "M: mpirun across the nodes: exit code $rc"
expect_line M "^0 +$N1 +0-1 "
expect_line M "^1 +$N2 +2-3 "
expect_line M "^dt_topo: all checks passed on 4 ranks"
nodes_healthy
finish
