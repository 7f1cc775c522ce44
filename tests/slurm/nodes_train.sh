#!/usr/bin/env bash
# slurm.nodes.train: tensor parallelism on two namespaced nodes x 2 ranks.
#   1. --parallel.tp=2 --print-plan puts each tensor-parallel group on one node, read from the
#      hostnames in the placement lines; also with ranks dealt round robin over the nodes
#      (srun -m cyclic: ranks 0 2 on the first node, 1 3 on the second), and with parallel.auto
#      under a memory limit that plain data parallelism exceeds (it picks tp=2).
#   2. A short tp=2 run across the nodes logs the losses of the same run on one node
#      (mpiexec -n 4 here) within 1e-5 (relative).
source "$(dirname "$0")/lib.sh"
source "$DT_ROOT/tests/slurm/nodes_lib.sh"
need_nodes 2

TRAIN="$BIN_DIR/dt_train --config $CONFIG --data.path=$TEXT --qos.file=none"
# A model whose parameters dominate, so that tensor parallelism saves memory: dp=4 needs about
# 16.9 MiB a rank, dp=2 tp=2 14.4 MiB.
WIDE="--model.embd=192 --model.heads=4"
job P -N 2 --ntasks-per-node=2 -- "
$SRUN $TRAIN --parallel.tp=2 --print-plan --plan.dot=$WORK/block.dot
echo \"block rc=\$?\"
$SRUN -m cyclic $TRAIN --parallel.tp=2 --print-plan --plan.dot=$WORK/cyclic.dot | sed 's/^/cyclic: /'
echo \"cyclic rc=\${PIPESTATUS[0]}\"
$SRUN $TRAIN $WIDE --parallel.auto=true --mem.limit=15.5M --print-plan --plan.dot=$WORK/auto.dot | sed 's/^/auto: /'
echo \"auto rc=\${PIPESTATUS[0]}\""
[ "$JOB_END" = COMPLETED ] || fail "P: job $JOB ended $JOB_END, expected COMPLETED"
for v in block cyclic auto; do expect_line P "^$v rc=0$"; done
expect_line P "^dt_train: plan: dp=2 tp=2 pp=1 on 4 ranks"
expect_line P "^  dp 0 stage 0: ranks 0 1 on $N1$"
expect_line P "^  dp 1 stage 0: ranks 2 3 on $N2$"
expect_line P "^cyclic:   dp 0 stage 0: ranks 0 2 on $N1$"
expect_line P "^cyclic:   dp 1 stage 0: ranks 1 3 on $N2$"
expect_line P "^cyclic: rank 2 \\(dp 0, stage 0, tp 1 of 2\\) on $N1:"
expect_line P "^auto: dt_train: parallel.auto: dp=2 tp=2 pp=1: .* fits --mem.limit=15.5 MiB"
expect_line P "^auto:   dp 0 stage 0: ranks 0 1 on $N1$"
expect_line P "^auto:   dp 1 stage 0: ranks 2 3 on $N2$"
expect_no_line P "spans nodes"
# Every tensor-parallel group sits on one node: each placement line names exactly one host.
bad=$(grep -E "^(cyclic: |auto: )?  dp [0-9]+ stage [0-9]+: ranks .* on " P.out | grep -E " on [^ ]*,")
[ -z "$bad" ] || fail "tensor-parallel groups across nodes: $bad"

STEPS=20
job T -N 2 --ntasks-per-node=2 -- "$SRUN $TRAIN --parallel.tp=2 --train.steps=$STEPS" \
  "--train.log-file=$WORK/T.jsonl"
[ "$JOB_END" = COMPLETED ] || fail "T: job $JOB ended $JOB_END, expected COMPLETED"
expect_line T "^dt_train: done: $STEPS steps"
local_run A 4 --parallel.tp=2 --train.steps=$STEPS
steplog steps T.jsonl 1 "$STEPS"
steplog same A.jsonl T.jsonl 1 "$STEPS" 1e-5
echo "final loss: one node $($STEPLOG value A.jsonl $STEPS loss), two nodes $($STEPLOG value T.jsonl $STEPS loss)"
nodes_healthy
finish
