#!/usr/bin/env bash
# slurm.nodes.bench: dt_bench --check on two namespaced nodes x 2 ranks, under srun: the shared-
# memory all_reduce takes the hierarchical path (shared memory inside each node, MPI over TCP
# across them; path column "hier") and every result of every call is right, for every dtype, at
# odd sizes (1, 7, 49, ... bytes), with sum and other reductions.
source "$(dirname "$0")/lib.sh"
source "$DT_ROOT/tests/slurm/nodes_lib.sh"
need_nodes 2

# Each dtype with one reduction (sum on most; the others where the dtype has an exact range).
DTYPES="f32:sum f64:min bf16:avg f16:sum i32:avg i64:sum u8:max"
BENCH="$BIN_DIR/dt_bench --check --step-factor=7 --iters=2 --warmup=1 --min-bytes=1"
cmds=""
for dop in $DTYPES; do
  d=${dop%:*} op=${dop#*:}
  cmds+="$SRUN $BENCH --max-bytes=16K --dtype=$d --op=$op --ops=all_reduce --backends=shm,shm-copy | sed 's/^/$d: /'
echo \"$d rc=\${PIPESTATUS[0]}\"
"
done
# Every collective once on f32 and MPI as well (the collectives other than all_reduce take MPI
# across the nodes), sizes up to 1 MiB.
cmds+="$SRUN $BENCH --max-bytes=1M --backends=mpi,shm,shm-copy | sed 's/^/all: /'
echo \"all rc=\${PIPESTATUS[0]}\""
job B -N 2 --ntasks-per-node=2 -- "$cmds"
[ "$JOB_END" = COMPLETED ] || fail "B: job $JOB ended $JOB_END, expected COMPLETED"
for dop in $DTYPES; do
  d=${dop%:*} op=${dop#*:}
  expect_line B "^$d rc=0$"
  expect_line B "^$d: # Out of bounds values : 0 OK"
  # all_reduce rows: size count type redop root time algbw busbw #wrong backend path.
  expect_line B "^$d: +[0-9]+ +[0-9]+ +$d +$op .* 0 +shm +hier$"
  expect_line B "^$d: +[0-9]+ +[0-9]+ +$d +$op .* 0 +shm-copy +hier$"
  expect_no_line B "^$d: +[0-9].* (shm|mpi)$"
  # The sizes: 1, 7, 49, 343, 2401, 16384 bytes rounded down to whole elements (1 and 7 are
  # both 0 elements of 8 bytes).
  n=$(grep -cE "^$d: +[0-9]+ +[0-9]+ +$d .* shm +hier$" B.out)
  [ "$n" -ge 5 ] || fail "$d: $n sizes of shm all_reduce on the hierarchical path, expected 5 or 6"
done
expect_line B "^all rc=0$"
expect_line B "^all: # Out of bounds values : 0 OK"
for o in all_reduce all_gather reduce_scatter broadcast sendrecv; do
  expect_line B "^all: # $o$"
done
expect_line B "^all: +1048576 +262144 +f32 +sum .* 0 +shm +hier$"
nodes_healthy
finish
