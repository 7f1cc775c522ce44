#!/usr/bin/env bash
# slurm.preempt_start: a drain signal to the batch shell (scancel --batch --signal=USR1, the path
# of --signal=B:USR1@T) while srun waits to create the step. On the job's first run a step of its
# own holds both its CPUs for 6 s (started by an srun wrapper first on PATH, which then runs the
# real srun), so the script's srun retries its step a few seconds: a SIGUSR1 to srun then cancels
# the step ("Cancelled pending job step", exit 1), and the job would fail without a drain or a
# requeue. slurm/train.sbatch keeps the request until the ranks have started and can take it:
# they drain before their first step (exit 75), the job is requeued, and the requeued run trains
# to the end on the losses of an uninterrupted 2-rank run (within 1e-6, relative).
source "$(dirname "$0")/lib.sh"
need_cluster

STEPS=30
ARGS=(--train.steps="$STEPS" --train.batch=32 --train.log-every=10)
reference A "$STEPS" "${ARGS[@]:1}"

REAL_SRUN=$(command -v srun) || { fail "no srun on PATH"; finish; }
mkdir -p "$WORK/bin"
cat >"$WORK/bin/srun" <<EOS
#!/bin/bash
# The job's first run: a step of its own holds the job's CPUs for 6 s before the real srun asks
# for its step; $WORK/srun-waits says when it does.
if [ "\${SLURM_RESTART_COUNT:-0}" = 0 ]; then
  '$REAL_SRUN' -n 2 sleep 6 &
  sleep 1
  touch '$WORK/srun-waits'
fi
exec '$REAL_SRUN' "\$@"
EOS
chmod +x "$WORK/bin/srun"
SAVED_PATH=$PATH
export PATH=$WORK/bin:$PATH  # sbatch hands it to the job
submit P -n 2 -- "$CONFIG" --data.path="$TEXT" "${ARGS[@]}" --ckpt.dir="$WORK/ck" \
  --train.log-file="$WORK/P.jsonl"
PATH=$SAVED_PATH
[ -n "$JOB" ] || finish
t0=$SECONDS
until [ -e "$WORK/srun-waits" ] || [ $((SECONDS - t0)) -ge "$JOB_LIMIT" ]; do sleep 0.1; done
[ -e "$WORK/srun-waits" ] || { fail "the job's srun did not start in $JOB_LIMIT s"; finish; }
# The real srun now retries its step for about 4 s more.
sleep 1
echo "=== scancel --batch --signal=USR1 $JOB while srun waits for its step"
scancel --batch --signal=USR1 "$JOB" || fail "scancel --batch --signal=USR1 $JOB failed"
expect_end P "$JOB" COMPLETED
[ ! -e "$WORK/.dt-train-$JOB.size" ] || fail "the script left $WORK/.dt-train-$JOB.size behind"
[ "$(job_field "$JOB" Restarts)" = 1 ] ||
  fail "P: $(job_field "$JOB" Restarts) restarts, expected 1"
[ "$(job_field "$JOB" ExitCode)" = "0:0" ] || fail "P: exit code $(job_field "$JOB" ExitCode)"
expect_line P "^dt-train: SIGUSR1: asking the ranks to drain"
line="no rank on $NODE can take the drain request yet \\(srun may still be starting them\\);"
expect_line P "^dt-train: $line waiting$"
expect_line P "^dt-train: drain request passed on to the ranks on $NODE \\(pid [0-9 ]+\\)$"
expect_no_line P "Cancelled pending"
expect_line P "^dt_train: drained at step 0 \\(before its first step"
expect_line P "^dt-train: drained; requeueing job $JOB"
expect_line P "^dt-train: job $JOB restart 1: resuming"
expect_line P "^dt_train: done: $STEPS steps"
[ -f P.jsonl ] || { fail "no step log P.jsonl: the ranks never trained"; finish; }
steplog steps P.jsonl 1 "$STEPS"
steplog same A.jsonl P.jsonl 1 "$STEPS" 1e-6
node_healthy
no_job_groups "$JOB"
finish
