#!/usr/bin/env bash
# slurm.bad_input: user mistakes never drain the node or leave cgroups behind, and each gets a
# clear message:
#   an unknown tier (--comment=dt-qos=platinum): the job runs as best_effort, the job's output and
#     the QoS log say so;
#   a missing config: the job fails with exit code 2 naming the file, and is not requeued;
#   a bad --signal time (not a number, negative, beyond Slurm's 65535 s) or signal: sbatch refuses it,
#     naming --signal, and nothing is queued.
source "$(dirname "$0")/lib.sh"
need_cluster
QOS_LOG=$(hook_setting DT_QOS_LOG)

submit U -n 2 --comment=dt-qos=platinum -- "$CONFIG" --data.path="$TEXT" --train.steps=5
if [ -n "$JOB" ]; then
  expect_end U "$JOB" COMPLETED
  expect_line U "^dt_train: qos: tier best_effort \\(the job asked for tier 'platinum', which the QoS config does not define\\)"
  grep -q "job=$JOB: unknown QoS tier 'platinum' (comment).*the job runs as best_effort" "$QOS_LOG" ||
    fail "no line about tier 'platinum' of job $JOB in $QOS_LOG"
  node_healthy
  no_job_groups "$JOB"
fi

submit M -n 2 -- "$WORK/missing.ini" --data.path="$TEXT"
if [ -n "$JOB" ]; then
  expect_end M "$JOB" FAILED
  [ "$(job_field "$JOB" ExitCode)" = "2:0" ] || fail "M: exit code $(job_field "$JOB" ExitCode), expected 2:0"
  [ "$(job_field "$JOB" Restarts)" = 0 ] || fail "M: the job was requeued"
  expect_line M "^dt-train: error: config file '$WORK/missing.ini' \\(first argument\\) does not exist or is not readable$"
  node_healthy
  no_job_groups "$JOB"
fi

before=$(squeue -h | wc -l)
for spec in B:USR1@soon B:USR1@-30 B:USR1@99999 B:NOSUCHSIG@60; do
  echo "=== sbatch --signal=$spec"
  out=$(sbatch --parsable --signal="$spec" -n 2 -o "$WORK/S.out" "$SBATCH_SCRIPT" "$CONFIG" \
    --data.path="$TEXT" 2>&1)
  rc=$?
  echo "    $out (exit code $rc)"
  if [ $rc -eq 0 ]; then
    JOBS+=("${out%%;*}")
    fail "sbatch accepted --signal=$spec"
  fi
  grep -q -- "--signal" <<<"$out" || fail "sbatch's message for --signal=$spec does not name --signal"
done
[ "$(squeue -h | wc -l)" = "$before" ] || fail "jobs were queued: $(squeue -h)"
node_healthy
finish
