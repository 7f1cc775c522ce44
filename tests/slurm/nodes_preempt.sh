#!/usr/bin/env bash
# slurm.nodes.preempt: preemption of a two-node job, and its checkpoint read back on one node.
# `sbatch -N 2 --ntasks-per-node=2 slurm/train.sbatch` (4 ranks on two namespaced nodes) gets
# `scancel --signal=USR1` mid-training (at step 15, where the ranks wait for it:
# test.hold-at-step): the ranks on both nodes drain (checkpoint, exit 75), the
# script requeues the job held (DT_REQUEUE=hold); it is resized to one node with 2 tasks
# (scontrol update NumNodes=1-1 NumCPUs=2 NumTasks=2) and released, and the requeued run resumes on one node
# from the checkpoint the two nodes wrote and finishes. Every step is logged once over both runs
# and the losses (so the final one too) equal an uninterrupted 4-rank run's within 1e-4
# (relative; the resumed run sums gradients over 2 ranks, in another order). The drained
# checkpoint, written by ranks on two nodes, verifies with dt_ckpt verify on one node.
source "$(dirname "$0")/lib.sh"
source "$DT_ROOT/tests/slurm/nodes_lib.sh"
need_nodes 2

# A global batch of 32 sequences.
STEPS=100
ARGS=(--train.steps="$STEPS" --train.batch=32 --train.log-every=20 --train.eval-every=50)
local_run A 4 "${ARGS[@]}"

export DT_REQUEUE=hold
submit P -N 2 --ntasks-per-node=2 -- "$CONFIG" --data.path="$TEXT" "${ARGS[@]}" \
  --ckpt.dir="$WORK/ck" --train.log-file="$WORK/P.jsonl" --test.hold-at-step=15
[ -n "$JOB" ] || finish
# Step 15 logged: the ranks wait there (test.hold-at-step) until the signal drains them.
wait_lines P.jsonl 15 || finish
echo "=== scancel --signal=USR1 $JOB after $(wc -l <P.jsonl) logged steps"
scancel --signal=USR1 "$JOB" || fail "scancel --signal=USR1 $JOB failed"
wait_state "$JOB" PENDING 60
echo "=== requeued held ($(job_field "$JOB" Reason)); resizing to 1 node, 2 tasks and releasing"
[ "$(job_field "$JOB" Reason)" = job_requeued_in_held_state ] ||
  fail "the job is pending for '$(job_field "$JOB" Reason)', not requeued held"
# NumNodes=1 alone would mean 1-2 nodes; the job's 4 CPUs would not fit on one node.
scontrol update JobId="$JOB" NumNodes=1-1 NumCPUs=2 NumTasks=2 ||
  fail "scontrol update NumNodes=1-1 NumCPUs=2 NumTasks=2"
scontrol release "$JOB" || fail "scontrol release $JOB"
expect_end P "$JOB" COMPLETED
show_cores
[ "$(job_field "$JOB" Restarts)" = 1 ] || fail "P: $(job_field "$JOB" Restarts) restarts, expected 1"
[ "$(job_field "$JOB" ExitCode)" = "0:0" ] || fail "P: exit code $(job_field "$JOB" ExitCode)"

N=$(sed -n 's/.*drained at step \([0-9][0-9]*\).*/\1/p' P.out | head -n1)
if [ -z "$N" ]; then
  fail "no 'drained at step N' line"
  finish
fi
echo "drained at step $N"
[ "$N" = 15 ] || fail "drained at step $N, expected 15 (the run waits there for the signal)"
expect_line P "^dt_train: test.hold-at-step: step 15 done, waiting for a drain signal"
# The first run on both nodes, the resumed one on one of them.
expect_line P "^dt-train: job $JOB: 4 tasks on ${N1%1}\\[1-2\\],"
expect_line P "^dt-train: drained; requeueing job $JOB held"
expect_line P "^dt-train: job $JOB restart 1: resuming"
expect_line P "^dt-train: job $JOB: 2 tasks on ($N1|$N2),"
expect_line P "ckpt: resumed from .*/ck/step-$N\\.h5 at step $N "
expect_line P "^dt_train: done: $STEPS steps"
[ "$(grep -E '^dt_train: [0-9]+ ranks' P.out | sed 's/ ranks.*//; s/.* //' | tr '\n' ' ')" = "4 2 " ] ||
  fail "rank counts of the two runs: $(grep -E '^dt_train: [0-9]+ ranks' P.out | tr '\n' ';')"
steplog steps P.jsonl 1 "$STEPS"
steplog same A.jsonl P.jsonl 1 "$STEPS" 1e-4
echo "final loss: uninterrupted $($STEPLOG value A.jsonl $STEPS loss)," \
  "two nodes preempted and resumed on one $($STEPLOG value P.jsonl $STEPS loss)"

# The checkpoint the two nodes wrote, verified here (one node).
echo "=== dt_ckpt verify ck/step-$N.h5"
"$BIN_DIR/dt_ckpt" verify "ck/step-$N.h5" >verify.out 2>&1 || fail "dt_ckpt verify ck/step-$N.h5: exit code $?"
sed 's/^/    /' verify.out
nodes_healthy
nodes_no_job_groups "$JOB"
finish
