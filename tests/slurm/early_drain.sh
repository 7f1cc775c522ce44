#!/usr/bin/env bash
# slurm.early_drain: a drain signal that reaches slurm/train.sbatch before it has started the ranks
# (Slurm's --signal or scancel while the script still asks scontrol about the job) requeues the
# job without starting them, instead of killing the script (bash's default for SIGUSR1). The
# requeued run then starts as the first was to (its --ckpt.resume kept, here given as two
# arguments); a later restart, after ranks that ran, resumes from the folder (--ckpt.resume=auto).
# An early drain at a restart after a run that started the ranks (submitted with
# --ckpt.resume=pretrained.h5, run 0 trains and drains, run 1 is drained before srun) leaves run 2
# resuming from the folder (--ckpt.resume=auto), not from pretrained.h5 again.
# A drain signal once srun runs but before the ranks can take it: while srun creates the step
# (real srun forwards no signal then: it drops it, dies of it, or cancels a step waiting for its
# resources) and while a rank starts (exec, libraries: it would die of SIGUSR1). The script keeps
# the request until the ranks on its node have their drain handler in place, then sends it to
# them; they drain (75) and the job is requeued, its .size file kept (a signal sent on to srun at
# once would end srun or the rank: exit 138, neither drained nor requeued).
# The script runs outside Slurm here: scontrol and srun are stand-ins on PATH, so that the
# signal can be sent while scontrol is known to be running (the seam); srun must not be called
# then. srun exits with SHIM_RC (default 0; 75 as dt_train after a drain); with SHIM_LAUNCH it
# starts a stand-in rank as srun starts a step (see below).
#   early_drain.sh WORKDIR SCRIPT DT_BIN CONFIG
set -u
WORK=$1 SCRIPT=$2 BIN=$3 CONFIG=$4
rm -rf "$WORK"
mkdir -p "$WORK/bin"
cat >"$WORK/bin/scontrol" <<'EOS'
#!/bin/sh
echo "scontrol $*" >>"$SHIM_LOG"
[ "$1 $2" != "show hostnames" ] || { echo "$3" | tr , '\n'; exit 0; }
case "$1" in show) touch "$SHIM_LOG.asked"; [ -z "${SHIM_SLOW:-}" ] || sleep 3 ;; esac
exit 0
EOS
# squeue -s: once srun has started its task, the steps in SHIM_STEPS (lines "ID NAME NODES").
cat >"$WORK/bin/squeue" <<'EOS'
#!/bin/sh
echo "squeue $*" >>"$SHIM_LOG"
[ ! -e "$SHIM_LOG.launched" ] || printf '%s\n' "${SHIM_STEPS:-}"
EOS
# With SHIM_LAUNCH, srun starts a step: while it creates it (SHIM_CREATE_S) a SIGUSR1 has its
# default action and ends it; then it starts the task (its command line's program, with the
# SLURM_STEP_ID slurmstepd gives a task), forwards SIGUSR1 to it and exits with its exit code.
# SHIM_LAUNCH=remote: the task runs as on another node (under another name: not a rank of this
# node); SHIM_LAUNCH=late: it takes SHIM_LATE_S to start (exec) the program.
cat >"$WORK/bin/srun" <<'EOS'
#!/bin/bash
echo "srun $*" >>"$SHIM_LOG"
[ -n "${SHIM_LAUNCH:-}" ] || exit "${SHIM_RC:-0}"
touch "$SHIM_LOG.creating"
sleep "${SHIM_CREATE_S:-2}"
while [ "${1#-}" != "$1" ]; do shift; done
case $SHIM_LAUNCH in
  remote) SLURM_STEP_ID=0 bash "$@" & ;;
  late) SLURM_STEP_ID=0 bash -c 'sleep "$SHIM_LATE_S"; exec "$@"' task "$@" & ;;
  *) SLURM_STEP_ID=0 "$@" & ;;
esac
task=$!
trap 'kill -USR1 $task' USR1
touch "$SHIM_LOG.launched"
while kill -0 "$task" 2>/dev/null; do wait "$task"; done
wait "$task"
EOS
# The stand-in rank (DT_BIN=$WORK/rank): a SIGUSR1 has its default action until its drain
# handler is in place, SHIM_EXEC_S after its start; a drain request then ends it as dt_train's
# drain does (exit 75); without one it ends after 20 s (exit 0).
mkdir -p "$WORK/rank"
cat >"$WORK/rank/dt_train" <<'EOS'
#!/bin/bash
echo "rank: started" >>"$SHIM_LOG"
sleep "${SHIM_EXEC_S:-1}"
drain=
trap 'drain=1' USR1
echo "rank: drain handler in place" >>"$SHIM_LOG"
for _ in $(seq 200); do
  [ -z "$drain" ] || break
  sleep 0.1
done
if [ -n "$drain" ]; then
  echo "rank: drained" >>"$SHIM_LOG"
  exit 75
fi
echo "rank: done" >>"$SHIM_LOG"
EOS
chmod +x "$WORK/bin/scontrol" "$WORK/bin/squeue" "$WORK/bin/srun" "$WORK/rank/dt_train"
export SHIM_LOG=$WORK/shim.log PATH=$WORK/bin:$PATH SLURM_JOB_ID=7 SLURM_RESTART_COUNT=0 \
  SLURM_SUBMIT_DIR=$WORK DT_BIN=$BIN
# drained_early OUT ARGS...: runs the script with ARGS (restart SLURM_RESTART_COUNT), its output
# in OUT, and sends it SIGUSR1 while it asks scontrol about the job; its exit code in $rc.
drained_early() {
  local out=$1 pid
  shift
  rm -f "$SHIM_LOG.asked"
  SHIM_SLOW=1 bash "$SCRIPT" "$@" >"$out" 2>&1 &
  pid=$!
  for _ in $(seq 1 100); do
    [ -e "$SHIM_LOG.asked" ] && break
    sleep 0.1
  done
  kill -USR1 "$pid"
  wait "$pid"
  rc=$?
  cat "$out" "$SHIM_LOG"
  echo "early_drain.sh: exit code $rc"
}
drained_early "$WORK/out" "$CONFIG" --ckpt.dir="$WORK/ck" --ckpt.resume none
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
[ -e "$SHIM_LOG.asked" ] || fail "the script never asked scontrol about the job"
[ "$rc" -eq 0 ] || fail "exit code $rc, expected 0 (requeued)"
grep -q "^dt-train: SIGUSR1: asking the ranks to drain$" "$WORK/out" || fail "no line about SIGUSR1"
grep -q "^dt-train: drained before the ranks started (SIGUSR1)$" "$WORK/out" ||
  fail "no line about a drain before the ranks started"
grep -q "^dt-train: drained; requeueing job 7$" "$WORK/out" || fail "no line about the requeue"
grep -q "^scontrol requeue 7$" "$SHIM_LOG" || fail "scontrol requeue 7 was not called"
! grep -q "^srun" "$SHIM_LOG" || fail "srun was called: the ranks started"
[ -e "$WORK/.dt-train-7.early" ] || fail "no $WORK/.dt-train-7.early left for the requeued run"
# The requeued run (restart 1) starts as the first was to; the next (restart 2) resumes.
for restart in 1 2; do
  : >"$SHIM_LOG"
  SLURM_RESTART_COUNT=$restart bash "$SCRIPT" "$CONFIG" --ckpt.dir="$WORK/ck" --ckpt.resume none \
    >"$WORK/out$restart" 2>&1
  echo "=== restart $restart: exit code $?"
  cat "$WORK/out$restart" "$SHIM_LOG"
  run=$(grep "^srun" "$SHIM_LOG")
  [ -n "$run" ] || fail "restart $restart: srun was not called"
  if [ "$restart" = 1 ]; then
    [[ $run == *" --ckpt.resume none"* && $run != *"--ckpt.resume=auto"* ]] ||
      fail "restart 1 did not start as the first run was to: $run"
    grep -q "the last run drained before its ranks started; starting as it was to" "$WORK/out1" ||
      fail "restart 1 does not say it starts as the first run was to"
    [ ! -e "$WORK/.dt-train-7.early" ] || fail "restart 1 left $WORK/.dt-train-7.early"
  else
    [[ $run == *"--ckpt.resume=auto"* && $run != *"--ckpt.resume none"* ]] ||
      fail "restart 2 does not resume from the folder: $run"
  fi
done

# Submitted with --ckpt.resume=pretrained.h5: run 0 starts the ranks, which drain (75); run 1 is
# drained before srun; run 2 resumes from the folder (the checkpoint run 0's drain saved).
echo "=== a run that trained, then an early drain at restart 1"
rm -f "$WORK/.dt-train-7.early" "$WORK/.dt-train-7.size"
resume=--ckpt.resume=$WORK/pretrained.h5
: >"$SHIM_LOG"
SHIM_RC=75 bash "$SCRIPT" "$CONFIG" --ckpt.dir="$WORK/ck" "$resume" >"$WORK/trained0" 2>&1
rc=$?
cat "$WORK/trained0" "$SHIM_LOG"
[ "$rc" -eq 0 ] || fail "run 0: exit code $rc, expected 0 (requeued after the drain)"
grep -q "^srun .* $resume" "$SHIM_LOG" || fail "run 0 did not start the ranks with $resume"
grep -q "^scontrol requeue 7$" "$SHIM_LOG" || fail "run 0: scontrol requeue 7 was not called"
: >"$SHIM_LOG"
SLURM_RESTART_COUNT=1 drained_early "$WORK/trained1" "$CONFIG" --ckpt.dir="$WORK/ck" "$resume"
[ "$rc" -eq 0 ] || fail "restart 1: exit code $rc, expected 0 (requeued)"
grep -q "^dt-train: drained before the ranks started (SIGUSR1)$" "$WORK/trained1" ||
  fail "restart 1: no line about a drain before the ranks started"
! grep -q "^srun" "$SHIM_LOG" || fail "restart 1: srun was called: the ranks started"
: >"$SHIM_LOG"
SLURM_RESTART_COUNT=2 bash "$SCRIPT" "$CONFIG" --ckpt.dir="$WORK/ck" "$resume" >"$WORK/trained2" 2>&1
echo "=== restart 2: exit code $?"
cat "$WORK/trained2" "$SHIM_LOG"
run=$(grep "^srun" "$SHIM_LOG")
[ -n "$run" ] || fail "restart 2: srun was not called"
[[ $run == *"--ckpt.resume=auto"* && $run != *"$resume"* ]] ||
  fail "restart 2 does not resume from the folder after run 0 trained: $run"
[ ! -e "$WORK/.dt-train-7.early" ] || fail "restart 2 left $WORK/.dt-train-7.early"
# drain_while CASE MARK VAR=VALUE...: runs the script for job $J with the stand-ins' settings
# VAR=VALUE, its output in $WORK/CASE.out, and sends it SIGUSR1 once srun got to MARK (a file
# $SHIM_LOG.MARK); then checks what every such case shows: the rank drained and the job was
# requeued (exit 0). (Job id 99999999 is past Slurm's largest, so that no rank of a real job on
# this machine is taken.)
J=99999999
drain_while() {
  local at=$1 mark=$2 pid
  shift 2
  rm -f "$WORK/.dt-train-$J.early" "$WORK/.dt-train-$J.size" "$SHIM_LOG".*
  : >"$SHIM_LOG"
  env SLURM_JOB_ID=$J DT_BIN="$WORK/rank" "$@" \
    bash "$SCRIPT" "$CONFIG" --ckpt.dir="$WORK/ck" >"$WORK/$at.out" 2>&1 &
  pid=$!
  for _ in $(seq 1 100); do
    [ -e "$SHIM_LOG.$mark" ] && break
    sleep 0.05
  done
  [ -e "$SHIM_LOG.$mark" ] || fail "$at: srun never got to $mark"
  kill -USR1 "$pid"
  wait "$pid"
  rc=$?
  cat "$WORK/$at.out" "$SHIM_LOG"
  echo "early_drain.sh: exit code $rc"
  [ "$rc" -eq 0 ] || fail "$at: exit code $rc, expected 0 (drained and requeued)"
  grep -q "^rank: drained$" "$SHIM_LOG" || fail "$at: the rank did not drain"
  grep -q "^scontrol requeue $J$" "$SHIM_LOG" || fail "$at: scontrol requeue $J was not called"
}
passed_to_ranks="^dt-train: drain request passed on to the ranks on [^ ]* (pid [0-9 ]*)$"
# A drain signal while srun creates the step (creating), and while the rank starts (launched):
# the script waits for the rank's drain handler, the rank drains, the job is requeued.
for at in creating launched; do
  echo "=== a drain signal once srun runs, while $at"
  drain_while $at $at SHIM_LAUNCH=1 SHIM_CREATE_S=2 SHIM_EXEC_S=2
  grep -q "^rank: drain handler in place$" "$SHIM_LOG" ||
    fail "$at: the rank never had its drain handler"
  line="no rank on [^ ]* can take the drain request yet (srun may still be starting them); waiting"
  grep -q "^dt-train: $line$" "$WORK/$at.out" || fail "$at: no line about the request waiting"
  grep -q "$passed_to_ranks" "$WORK/$at.out" || fail "$at: no line about the drain request passed on"
  [ -e "$WORK/.dt-train-$J.size" ] ||
    fail "$at: $WORK/.dt-train-$J.size removed: the run was taken for a failure"
  [ ! -e "$WORK/.dt-train-$J.early" ] ||
    fail "$at: $WORK/.dt-train-$J.early left: the ranks had started"
done
# No rank on this node: the step of an array's task (500_2, job id $J) runs on n2 and n3, and
# the array's other task has a step on this node (n1). The request goes to srun 10 s after the
# step is listed; srun passes it to the rank. A rank that starts on this node 14 s after its step
# is listed there gets it itself (sent to srun, the starting rank would die of it: exit 138).
stand_in=(SLURMD_NODENAME=n1 SHIM_CREATE_S=1 SHIM_LATE_S=14 SHIM_EXEC_S=1)
echo "=== a drain signal with no rank on this node (remote)"
drain_while remote launched "${stand_in[@]}" SHIM_LAUNCH=remote SLURM_ARRAY_JOB_ID=500 \
  SLURM_ARRAY_TASK_ID=2 SHIM_STEPS="$(printf '%s\n' "500_2.batch batch n1" \
  "500_1.0 dt_train n1" "500_2.0 dt_train n2,n3")"
line="no rank of job $J on [^ ]*: its step runs on n2,n3; drain request passed on to srun"
grep -q "^dt-train: $line$" "$WORK/remote.out" || fail "remote: no line about srun taking it"
echo "=== a drain signal while the rank on this node starts late (late)"
drain_while late launched "${stand_in[@]}" SHIM_LAUNCH=late \
  SHIM_STEPS="$(printf '%s\n' "$J.batch batch n1" "$J.0 dt_train n2,n1")"
! grep -q "passed on to srun" "$WORK/late.out" || fail "late: the request went to srun"
grep -q "$passed_to_ranks" "$WORK/late.out" || fail "late: no line about the drain request passed on"
[ $FAILED -eq 0 ] && { echo "early_drain.sh: PASS"; exit 0; }
echo "early_drain.sh: FAIL"
exit 1
