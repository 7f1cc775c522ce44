#!/usr/bin/env bash
# ckpt.drain_signal_usr1 / ckpt.drain_signal_term / ckpt.drain_log_complete (MODE usr1, term,
# log_complete): a long 2-rank run gets a drain signal, twice, on ONE rank (usr1: SIGUSR1 to
# rank 1; term: SIGTERM to rank 0). Every rank stops at the same step boundary N, step-N.h5 is
# committed, "drained at step N" is printed and the job exits 75; a run with --train.steps=N+3
# resumes from step-N.h5 at step N and exits 0.
# log_complete (SIGUSR1 to rank 1) also wants the step log of the drained run and the resumed
# run together to hold every step 1..N+3 once: the step the job drained at was trained and saved,
# so it is logged too.
# last_step (SIGUSR1 to rank 1 while the run holds after its last step 5): the run is done, so it
# exits 0 with its summary and step-5.h5, not 75 (which would have it requeued for nothing).
# after_failed_async (SIGUSR1 to rank 1): background saves every 2 steps, the one of step 4 fails
# (test.fail-save-at-step), and the job holds after step 5 for the signal: the drain still saves
# step 5, after a warning naming the failed save, and exits 75; step-2.h5 stays.
# no_dir (SIGUSR1 to rank 1, no --ckpt.dir): the run drains all the same, says that nothing was
# saved, and exits 76, which job scripts do not requeue (a requeued run would start afresh).
# startup (SIGUSR1 to rank 1 while it starts up, test.start-delay-s, before MPI starts): the
# signal is kept, not fatal; the job drains before its first step, writes nothing (the folder has
# nothing newer to resume from) and exits 75; the requeued run starts at step 0.
# during_failed_async (SIGUSR1 to rank 1 while the run holds after step 3, whose background save
# (ckpt.async, ckpt.every=3) fails): the drain saves step 3 again, after a warning, and exits 75.
# startup_named (as startup, with --ckpt.resume naming a checkpoint outside the folder): the
# drain before the first step saves that start into the folder, where the requeued run
# (resume=auto) finds it.
# during_save (SIGUSR1 to rank 1 while the save of step 3 (ckpt.every=3) is slow,
# test.save-delay-s): that save is the drained checkpoint; the job drains at step 3 without
# training and saving step 4.
# failed_save (SIGUSR1 to rank 1 while the run holds after step 3; saves every 2 steps, and the
# drain's save of step 3 fails, test.fail-save-at-step): the job still drains (exit 75, to be
# requeued), naming the failure and step-2.h5, where the requeued run resumes; a run that
# committed nothing and started with --ckpt.resume=none ends with exit 3 in that case.
source "$(dirname "$0")/lib.sh"

EXTRA=() WAIT_STEPS=3 STEPS=100000
case "$MODE" in
  last_step)  # the signal comes during the last step: the run ends as done, not drained
    SIG=USR1 RANK=1 WAIT_STEPS=5 STEPS=5 EXTRA=(--test.hold-at-step=5)
    ;;
  usr1 | log_complete) SIG=USR1 RANK=1 ;;
  term) SIG=TERM RANK=0 ;;
  no_dir) SIG=USR1 RANK=1 ;;
  startup) SIG=USR1 RANK=1 WAIT_STEPS=0 EXTRA=(--test.start-delay-s=8) ;;
  during_save) SIG=USR1 RANK=1 EXTRA=(--ckpt.every=3 --test.save-delay-s=4) ;;
  during_failed_async)
    SIG=USR1 RANK=1
    EXTRA=(--ckpt.async=true --ckpt.every=3 --test.fail-save-at-step=3 --test.hold-at-step=3)
    ;;
  startup_named)
    # A checkpoint of step 2 outside the folder to start from.
    train P 1 --train.steps=2 --ckpt.dir="$WORK/P"
    expect_rc P 0
    SIG=USR1 RANK=1 WAIT_STEPS=0
    EXTRA=(--test.start-delay-s=8 --ckpt.resume="$WORK/P/step-2.h5")
    ;;
  failed_save)
    SIG=USR1 RANK=1 EXTRA=(--ckpt.every=2 --test.fail-save-at-step=3 --test.hold-at-step=3)
    ;;
  after_failed_async)
    SIG=USR1 RANK=1 WAIT_STEPS=5
    EXTRA=(--ckpt.async=true --ckpt.every=2 --test.fail-save-at-step=4 --test.hold-at-step=5)
    ;;
  *) echo "unknown mode '$MODE'"; exit 2 ;;
esac

D=$WORK/D
DIR=(--ckpt.dir="$D")
[ "$MODE" = no_dir ] && DIR=()
echo "=== L: 2 ranks in the background: dt_train --train.steps=$STEPS ${DIR[*]}"
timeout -k 10 "$RUN_LIMIT" "${MPIEXEC[@]}" -n 2 "$BIN" --config "$CONFIG" --data.path="$TEXT" \
  --train.steps="$STEPS" --train.log-every=1000 "${DIR[@]}" --train.log-file="$WORK/L.jsonl" \
  "${EXTRA[@]}" >L.out 2>&1 &
job=$!

# Wait for WAIT_STEPS logged steps (the job is training) or for the job to end early.
if [ "$WAIT_STEPS" -gt 0 ]; then
  for _ in $(seq 600); do
    [ -f L.jsonl ] && [ "$(wc -l <L.jsonl)" -ge "$WAIT_STEPS" ] && break
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  [ -f L.jsonl ] && [ "$(wc -l <L.jsonl)" -ge "$WAIT_STEPS" ] ||
    fail "the run logged fewer than $WAIT_STEPS steps"
fi

ranks_re="--train\.log-file=$WORK/L\.jsonl( |\$)"
if [ "$MODE" = startup ] || [ "$MODE" = startup_named ]; then
  # Both ranks have started and caught SIGUSR1 (SigCgt bit 10), within their 8 s start-up wait.
  for _ in $(seq 250); do
    n=0
    for p in $(pgrep -f -- "^$BIN .*$ranks_re"); do
      mask=$(sed -n 's/^SigCgt:\s*//p' "/proc/$p/status" 2>/dev/null)
      [ -n "$mask" ] && (((16#$mask >> 9) & 1)) && n=$((n + 1))
    done
    [ "$n" -ge 2 ] && break
    sleep 0.02
  done
  [ "$n" -ge 2 ] || fail "the ranks did not start (or catch SIGUSR1) in time"
  grep -q "starting from step\|^step " L.out && fail "the run was past its start-up: $(cat L.out)"
fi
echo "rank processes: $(pgrep -f -- "^$BIN .*$ranks_re" | tr '\n' ' ')"
pid=$(rank_pid_of "$ranks_re" "$RANK")
if [ -z "$pid" ]; then
  fail "no process of rank $RANK found"
  kill -TERM "$job" 2>/dev/null  # timeout passes it on to mpiexec and the ranks
else
  echo "sending SIG$SIG twice to rank $RANK (pid $pid)"
  kill -"$SIG" "$pid"
  kill -"$SIG" "$pid" 2>/dev/null  # the rank may already be on its way out
fi
wait "$job"
RC=$?
sed 's/^/    /' L.out
echo "=== L: exit code $RC"
if [ "$MODE" = last_step ]; then
  expect_rc L 0
  expect_no_line L "drained at step"
  expect_line L "^dt_train: done: 5 steps"
  expect_latest "$D" "step-5.h5"
  finish
fi
if [ "$MODE" = no_dir ]; then
  expect_rc L 76
  expect_line L "^dt_train: drained at step [0-9]+ \(no ckpt\.dir: nothing saved\), exit code 76"
  expect_no_file "$D"
  finish
fi
expect_rc L 75
if [ "$MODE" = startup ]; then
  expect_line L "^dt_train: drained at step 0 \(before its first step: the checkpoints in .*/D are where it resumes\), exit code 75$"
  [ -z "$(files_in "$D")" ] || fail "files in the checkpoint directory: $(files_in "$D")"
  train R 2 --train.steps=3 --ckpt.dir="$D" --train.log-file="$WORK/R.jsonl"
  expect_rc R 0
  steplog steps R.jsonl 1 3
  expect_latest "$D" "step-3.h5"
  finish
fi
if [ "$MODE" = startup_named ]; then
  expect_line L "^dt_train: drained at step 2 \(checkpoint in .*/D\), exit code 75$"
  [ "$(files_in "$D")" = "latest step-2.h5" ] || fail "files in the checkpoint directory: $(files_in "$D")"
  train R 2 --train.steps=4 --ckpt.dir="$D" --train.log-file="$WORK/R.jsonl"
  expect_rc R 0
  expect_line R "resumed from .*D/step-2\.h5 at step 2 "
  finish
fi
if [ "$MODE" = failed_save ]; then
  expect_line L "ckpt: warning: the drain's checkpoint of step 3 could not be saved: .*test\.fail-save-at-step: the save of step 3 .*; a requeued run resumes from .*/D/step-2\.h5 \(this run's latest checkpoint in .*/D\)"
  expect_line L "^dt_train: drained at step 3 \(its checkpoint not saved: .*/D/step-2\.h5 is where it resumes\), exit code 75$"
  # (The seam fails the save after its writes, before the commit: the uncommitted file stays
  # until the next save, and the resume passes it by.)
  [ "$(files_in "$D")" = "latest step-2.h5 step-3.h5.partial" ] ||
    fail "files in the checkpoint directory: $(files_in "$D")"
  train R 2 --train.steps=5 --ckpt.dir="$D" --train.log-file="$WORK/R.jsonl"
  expect_rc R 0
  expect_line R "resumed from .*D/step-2\.h5 at step 2 "
  steplog steps R.jsonl 3 5
  # A run that has committed nothing and did not resume from the folder (--ckpt.resume=none into
  # D, whose step-5.h5 is R's): its failed drain save ends it (exit 3), as R's checkpoint is no
  # place for it to go on from.
  echo "=== N: 2 ranks in the background: dt_train --ckpt.resume=none --ckpt.dir=$D"
  timeout -k 10 "$RUN_LIMIT" "${MPIEXEC[@]}" -n 2 "$BIN" --config "$CONFIG" --data.path="$TEXT" \
    --train.steps=100000 --train.log-every=1000 --ckpt.dir="$D" --ckpt.resume=none \
    --train.log-file="$WORK/N.jsonl" --ckpt.every=100 --test.fail-save-at-step=3 \
    --test.hold-at-step=3 >N.out 2>&1 &
  job=$!
  for _ in $(seq 600); do
    grep -q "test.hold-at-step: step 3 done" N.out 2>/dev/null && break
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  pid=$(rank_pid_of "--train\.log-file=$WORK/N\.jsonl( |\$)" 1)
  [ -n "$pid" ] && kill -USR1 "$pid" || { fail "no rank 1 of N"; kill -TERM "$job"; }
  wait "$job"
  RC=$?
  sed 's/^/    /' N.out
  expect_rc N 3
  expect_line N "test\.fail-save-at-step: the save of step 3"
  expect_no_line N "drained at step|a requeued run resumes"
  expect_latest "$D" "step-5.h5"
  finish
fi
N=$(sed -n 's/.*drained at step \([0-9][0-9]*\).*/\1/p' L.out | head -n1)
if [ -z "$N" ]; then
  fail "no 'drained at step N' line"
  finish
fi
echo "drained at step $N"
[ "$N" -ge 3 ] || fail "drained at step $N, before the 3 logged steps"
[ "$(grep -c 'drained at step' L.out)" -eq 1 ] || fail "more than one 'drained' line"
expect_file "$D/step-$N.h5"
expect_latest "$D" "step-$N.h5"
if [ "$MODE" = during_failed_async ]; then
  [ "$N" -eq 3 ] || fail "drained at step $N, expected the held step 3"
  expect_line L "ckpt: warning: the background save of step 3 failed: .*test\.fail-save-at-step: the save of step 3 .*; saving it now"
fi
if [ "$MODE" = during_save ]; then
  [ "$N" -eq 3 ] || fail "drained at step $N, expected 3, whose save the signal came during"
  [ "$(wc -l <L.jsonl)" -eq 3 ] || fail "the drained run logged $(wc -l <L.jsonl) steps, expected 3"
fi
if [ "$MODE" = after_failed_async ]; then
  [ "$N" -eq 5 ] || fail "drained at step $N, expected the held step 5"
  expect_line L "ckpt: warning: an earlier background save failed: .*test\.fail-save-at-step: the save of step 4 .*; saving step 5 now"
  [ "$(files_in "$D")" = "latest step-2.h5 step-5.h5" ] ||
    fail "files in the checkpoint directory: $(files_in "$D")"
else
  [ "$(files_in "$D")" = "latest step-$N.h5" ] ||
    fail "files in the checkpoint directory: $(files_in "$D")"
fi

# Requeued: resumes from the drained checkpoint (which thereby verifies) and finishes.
train R 2 --train.steps=$((N + 3)) --ckpt.dir="$D" --train.log-file="$WORK/R.jsonl"
expect_rc R 0
expect_line R "resumed from .*D/step-$N\.h5 at step $N "
expect_no_line R "skipping"
steplog steps R.jsonl $((N + 1)) $((N + 3))
expect_latest "$D" "step-$((N + 3)).h5"

if [ "$MODE" = log_complete ]; then
  cat L.jsonl R.jsonl >all.jsonl
  steplog steps all.jsonl 1 $((N + 3))
fi
finish
