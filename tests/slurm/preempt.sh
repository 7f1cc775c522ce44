#!/usr/bin/env bash
# slurm.preempt_requeue (MODE batch) / slurm.preempt_resize (MODE resize): preemption end to end.
# A 2-task job of slurm/train.sbatch gets SIGUSR1 in the middle of training, at step 15, where its
# ranks wait for it (test.hold-at-step):
#   batch:  scancel --batch --signal=USR1: to the batch shell, the path of --signal=B:USR1@T; the
#           script passes it on to the ranks;
#   resize: scancel --signal=USR1: to the ranks directly; the job is requeued held
#           (DT_REQUEUE=hold), resized to 1 task (scontrol update) and released;
#   term:   scancel --batch --signal=TERM: to the batch shell, which passes it on as SIGUSR1
#           (srun would end the step on its own SIGTERM, killing the ranks); this job gives its
#           options as two arguments (--ckpt.dir DIR --ckpt.resume none), which the script must
#           read as given (no "no --ckpt.dir" warning) and replace on the restart (one
#           --ckpt.resume, auto);
#   one_task: a 1-task job (sbatch -n 1 under the script's --ntasks-per-node=2, for which Slurm
#           shows NumTasks=2 also on the first run), scancel --signal=USR1: the requeued run
#           keeps its 1 task;
#   grow:   the same 1-task job, requeued held and grown to 2 tasks (NumTasks, TasksPerNode and
#           NumCPUs) before its release: the restart runs 2 ranks.
# The ranks drain (checkpoint, exit 75), the script requeues the job, the requeued run resumes
# from the drained checkpoint and finishes. Every step is logged once over both runs, and the
# losses (every step's, so the final one too) equal an uninterrupted 2-rank run's: within 1e-6
# (relative) on the same 2 ranks, within 1e-4 after resizing to 1 rank (the gradient sum is then
# taken in another order, and float rounding differences grow over the steps).
source "$(dirname "$0")/lib.sh"
need_cluster

# A global batch of 32 sequences: about 20 ms a step here.
STEPS=100
ARGS=(--train.steps="$STEPS" --train.batch=32 --train.log-every=20 --train.eval-every=50)

TASKS=2
case "$MODE" in
  batch) env=() scancel_args=(--batch --signal=USR1) rtol=1e-6 ;;
  resize) env=(DT_REQUEUE=hold) scancel_args=(--signal=USR1) rtol=1e-4 ;;
  term) env=() scancel_args=(--batch --signal=TERM) rtol=1e-6 ;;
  one_task) env=() scancel_args=(--signal=USR1) rtol=1e-6 TASKS=1 REF_RANKS=1 ;;
  grow) env=(DT_REQUEUE=hold) scancel_args=(--signal=USR1) rtol=1e-4 TASKS=1 REF_RANKS=1 ;;
  *) echo "unknown mode '$MODE'"; exit 2 ;;
esac
reference A "$STEPS" "${ARGS[@]:1}"
[ ${#env[@]} -eq 0 ] || export "${env[@]}"
CKPT=(--ckpt.dir="$WORK/ck")
[ "$MODE" != term ] || CKPT=(--ckpt.dir "$WORK/ck" --ckpt.resume none)
submit P -n "$TASKS" -- "$CONFIG" --data.path="$TEXT" "${ARGS[@]}" "${CKPT[@]}" \
  --train.log-file="$WORK/P.jsonl" --test.hold-at-step=15
[ -n "$JOB" ] || finish
# Mid-training: 15 steps logged, most still to come; the ranks wait there (test.hold-at-step)
# until the signal drains them, however long it takes to reach them.
wait_lines P.jsonl 15 || finish
echo "=== scancel ${scancel_args[*]} $JOB after $(wc -l <P.jsonl) logged steps"
scancel "${scancel_args[@]}" "$JOB" || fail "scancel ${scancel_args[*]} $JOB failed"

if [ "$MODE" = resize ] || [ "$MODE" = grow ]; then
  wait_state "$JOB" PENDING 60
  echo "=== requeued held ($(job_field "$JOB" Reason)); resizing and releasing"
  [ "$(job_field "$JOB" Reason)" = job_requeued_in_held_state ] ||
    fail "the job is pending for '$(job_field "$JOB" Reason)', not requeued held"
  if [ "$MODE" = resize ]; then
    scontrol update JobId="$JOB" NumTasks=1 TasksPerNode=1 || fail "scontrol update NumTasks=1"
  else
    scontrol update JobId="$JOB" NumTasks=2 TasksPerNode=2 NumCPUs=2 ||
      fail "scontrol update NumTasks=2"
  fi
  scontrol release "$JOB" || fail "scontrol release $JOB"
fi
expect_end P "$JOB" COMPLETED
[ ! -e "$WORK/.dt-train-$JOB.size" ] || fail "the script left $WORK/.dt-train-$JOB.size behind"
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
[ "$MODE" != batch ] || expect_line P "^dt-train: SIGUSR1: asking the ranks to drain"
[ "$MODE" != term ] || expect_line P "^dt-train: SIGTERM: asking the ranks to drain"
expect_line P "^dt-train: drained; requeueing job $JOB"
expect_line P "^dt-train: job $JOB restart 1: resuming"
expect_no_line P "no --ckpt.dir|cannot be specified more than once"
expect_line P "ckpt: resumed from .*/ck/step-$N\\.h5 at step $N "
expect_line P "^dt_train: done: $STEPS steps"
if [ "$MODE" = resize ]; then
  expect_line P "^dt-train: the job now has 1 tasks \\(the first run had 2\\)"
  # The first run's line says 2 ranks, the resumed run's 1.
  [ "$(grep -E '^dt_train: [0-9]+ ranks,' P.out | sed 's/ ranks,.*//; s/.* //' | tr '\n' ' ')" = "2 1 " ] ||
    fail "rank counts of the two runs: $(grep -E '^dt_train: [0-9]+ ranks,' P.out | tr '\n' ';')"
fi
if [ "$MODE" = grow ]; then
  expect_line P "^dt-train: the job now has 2 tasks \\(the first run had 1\\)"
  [ "$(grep -E '^dt_train: [0-9]+ ranks,' P.out | sed 's/ ranks,.*//; s/.* //' | tr '\n' ' ')" = "1 2 " ] ||
    fail "rank counts of the two runs: $(grep -E '^dt_train: [0-9]+ ranks,' P.out | tr '\n' ';')"
fi
if [ "$MODE" = one_task ]; then
  expect_no_line P "^dt-train: the job now has"
  [ "$(grep -E '^dt_train: [0-9]+ ranks,' P.out | sed 's/ ranks,.*//; s/.* //' | tr '\n' ' ')" = "1 1 " ] ||
    fail "rank counts of the two runs: $(grep -E '^dt_train: [0-9]+ ranks,' P.out | tr '\n' ';')"
fi
steplog steps P.jsonl 1 "$STEPS"
steplog same A.jsonl P.jsonl 1 "$STEPS" "$rtol"
echo "final loss: uninterrupted $($STEPLOG value A.jsonl $STEPS loss)," \
  "preempted and requeued $($STEPLOG value P.jsonl $STEPS loss)"
node_healthy
no_job_groups "$JOB"
finish
