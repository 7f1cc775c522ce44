#!/usr/bin/env bash
# slurm.train: `sbatch -n 2 slurm/train.sbatch configs/micro.ini ...` trains to completion: the
# job ends COMPLETED with exit code 0 after every step, on 2 ranks, with a final checkpoint, and
# its losses are those of the same run under mpiexec, in qos.ini's default tier; the node stays
# healthy and the job's QoS cgroups and record are gone afterwards.
source "$(dirname "$0")/lib.sh"
need_cluster

STEPS=30
reference A "$STEPS"
submit T -n 2 -- "$CONFIG" --data.path="$TEXT" --train.steps=$STEPS --ckpt.dir="$WORK/ck" \
  --train.log-file="$WORK/T.jsonl"
[ -n "$JOB" ] || finish
expect_end T "$JOB" COMPLETED
[ "$(job_field "$JOB" ExitCode)" = "0:0" ] || fail "T: exit code $(job_field "$JOB" ExitCode)"
[ "$(job_field "$JOB" Restarts)" = 0 ] || fail "T: restarted $(job_field "$JOB" Restarts) times"
expect_line T "^dt_train: 2 ranks,"
expect_line T "^dt_train: done: $STEPS steps"
# No comment given, no Slurm QOS mapped here: qos.ini's [default] tier (the script sets none).
expect_line T "^dt_train: qos: tier best_effort \\(default\\)"
[ -f "ck/step-$STEPS.h5" ] || fail "no final checkpoint ck/step-$STEPS.h5"
steplog steps T.jsonl 1 "$STEPS"
steplog same A.jsonl T.jsonl 1 "$STEPS" 1e-5
node_healthy
no_job_groups "$JOB"
finish
