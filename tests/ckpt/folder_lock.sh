#!/usr/bin/env bash
# ckpt.folder_lock: one writer per checkpoint folder. While run A (2 ranks) trains into D and
# holds after step 2, a second run B into D (waiting 1 s for the claim) and a dt_ckpt import into
# D (--lock-wait-s 1) are refused with exit code 2, naming D and A (its host and the pid of its rank
# 0), B before it allocates its model; D is left byte for byte. A run W that waits up to 60 s
# starts as soon as A drains (exit 75) and trains on from A's checkpoint. A run killed with
# SIGKILL leaves the folder free (the claim ends with the process). A run waiting for the
# folder stops at a drain signal to any of its ranks (exit 75); a folder whose latest is a folder
# is refused, and so is a lock file that is a symbolic link or has a second name. A run waiting
# for a lock file that is removed meanwhile claims the new one of that name.
source "$(dirname "$0")/lib.sh"
D=$WORK/D
CKPT_TOOL=$(dirname "$BIN")/dt_ckpt

# start_held NAME DIR: a 2-rank run into DIR in the background (pid in $job) that holds after
# step 2 (and its save of step 2: step-2.h5 is there); waits until it holds.
start_held() {
  echo "=== $1: 2 ranks in the background: dt_train --ckpt.dir=$2 --test.hold-at-step=2"
  timeout -k 10 "$RUN_LIMIT" "${MPIEXEC[@]}" -n 2 "$BIN" --config "$CONFIG" --data.path="$TEXT" \
    --train.steps=5 --ckpt.every=1 --ckpt.dir="$2" --test.hold-at-step=2 >"$1.out" 2>&1 &
  job=$!
  for _ in $(seq 600); do
    grep -q "waiting for a drain signal" "$1.out" && return 0
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  sed 's/^/    /' "$1.out"
  fail "$1 never held at step 2"
  return 1
}
digest() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }
# start_waiting NAME WAIT ARGS...: a 2-rank run into D in the background (pid in $waiting) that
# waits up to WAIT s for the folder; returns once it says so.
start_waiting() {
  local name=$1 wait_s=$2
  shift 2
  echo "=== $name: 2 ranks in the background: dt_train --ckpt.dir=$D --ckpt.lock-wait-s=$wait_s $*"
  timeout -k 10 "$RUN_LIMIT" "${MPIEXEC[@]}" -n 2 "$BIN" --config "$CONFIG" --data.path="$TEXT" \
    --train.steps=4 --ckpt.dir="$D" --ckpt.lock-wait-s="$wait_s" "$@" >"$name.out" 2>&1 &
  waiting=$!
  for _ in $(seq 300); do
    grep -q "waiting up to $wait_s s" "$name.out" && return 0
    sleep 0.1
  done
  fail "$name does not say it waits for the folder"
}

start_held A "$D" || finish
a0=$(rank_pid "$D" 0)
[ -n "$a0" ] || fail "rank 0 of A not found"
before=$(digest "$D")

holder="dt_train on $(hostname), pid $a0, (Slurm job [0-9]+, )?since "
train B 2 --train.steps=5 --ckpt.every=1 --ckpt.dir="$D" --ckpt.lock-wait-s=1
expect_rc B 2
expect_line B "checkpoint folder .*/D is in use by $holder.*; waiting up to 1 s for it"
expect_line B "checkpoint folder .*/D is in use by another run \($holder"
expect_no_line B "dt_train: [0-9]+ parameters"
[ "$(digest "$D")" = "$before" ] || fail "the refused run changed $D"

echo "=== X: dt_ckpt export of A's step-1.h5, then import into D"
"$CKPT_TOOL" export "$D/step-1.h5" --output "$WORK/a.safetensors" >X.out 2>&1 ||
  { sed 's/^/    /' X.out; fail "export of $D/step-1.h5 failed"; }
"$CKPT_TOOL" import "$WORK/a.safetensors" --output "$D" --heads 2 --step 9 --lock-wait-s 1 \
  >I.out 2>&1
rc=$?
sed 's/^/    /' I.out
[ "$rc" -eq 2 ] || fail "dt_ckpt import into the folder in use: exit code $rc, expected 2"
grep -Eq "option --output: checkpoint folder .*/D is in use by another run \($holder" I.out ||
  fail "the refused import does not name the folder and its holder"
grep -Eq "checkpoint folder .*/D is in use by $holder.*; waiting up to 1 s for it" I.out ||
  fail "the refused import does not say it waits up to its --lock-wait-s"
[ "$(digest "$D")" = "$before" ] || fail "the refused import changed $D"

# A run that waits for the folder and gets a drain signal stops waiting at once: drained with
# nothing new saved (exit 75: a requeued run resumes from the folder), not refused, not started.
# S: SIGTERM to its rank 0, which waits; S1: SIGUSR1 to rank 1 only, which tells rank 0.
for S in S:61:0:TERM S1:62:1:USR1; do
  IFS=: read -r name wait_s rank sig <<<"$S"
  start_waiting "$name" "$wait_s"
  pid=$(rank_pid_of "--ckpt\.lock-wait-s=$wait_s( |\$)" "$rank")
  t0=$SECONDS
  if [ -n "$pid" ]; then
    kill -"$sig" "$pid"
  else
    fail "rank $rank of $name not found"
    kill -TERM "$waiting"
  fi
  wait "$waiting"
  RC=$?
  sed 's/^/    /' "$name.out"
  echo "=== $name: exit code $RC after $((SECONDS - t0)) s"
  expect_rc "$name" 75
  expect_line "$name" "^dt_train: stopped waiting for checkpoint folder .*/D \(in use by $holder.*\): a drain signal came"
  expect_line "$name" "drained before step 0 \(nothing new saved\), exit code 75"
  expect_no_line "$name" "error|--help"
  expect_no_line "$name" "dt_train: [0-9]+ parameters"
  [ $((SECONDS - t0)) -le 20 ] || fail "$name took $((SECONDS - t0)) s to stop after the signal"
  [ "$(digest "$D")" = "$before" ] || fail "the stopped run $name changed $D"
done

start_waiting W 60 --ckpt.every=1
w=$waiting

echo "sending SIGUSR1 to rank 0 of A (pid $a0)"
kill -USR1 "$a0"
wait "$job"
RC=$?
sed 's/^/    /' A.out
echo "=== A: exit code $RC"
expect_rc A 75
expect_line A "drained at step 2"
wait "$w"
RC=$?
sed 's/^/    /' W.out
echo "=== W: exit code $RC"
expect_rc W 0
expect_line W "resumed from .*D/step-2\.h5 at step 2 "
expect_latest "$D" step-4.h5

# A folder whose `latest` is a folder itself: no commit could replace it, so the claim is
# refused at once (exit 2), before the model exists, naming it.
mkdir -p "$WORK/L/latest"
train L 2 --train.steps=3 --ckpt.every=1 --ckpt.dir="$WORK/L"
expect_rc L 2
expect_line L "checkpoint folder .*/L: .*/L/latest is not a file"
expect_no_line L "dt_train: [0-9]+ parameters"

# A lock file that is a symbolic link, or a file with a second name (hard link), planted by
# another writer of a shared folder: refused (exit 2), naming it, and the file it points to is
# not written (the claim writes who holds it into the lock file).
echo "a file of this user's" >"$WORK/victim"
mkdir -p "$WORK/S" "$WORK/H"
ln -s "$WORK/victim" "$WORK/S/.dt-lock"
ln "$WORK/victim" "$WORK/H/.dt-lock"
train S 1 --train.steps=2 --ckpt.dir="$WORK/S"
expect_rc S 2
expect_line S "cannot open .*/S/\.dt-lock to claim checkpoint folder .*/S for this run: it is a symbolic link"
train H 1 --train.steps=2 --ckpt.dir="$WORK/H"
expect_rc H 2
expect_line H "cannot claim checkpoint folder .*/H for this run: .*/H/\.dt-lock has other names [(]hard links"
[ "$(cat "$WORK/victim")" = "a file of this user's" ] ||
  fail "the file the lock file named was written: '$(cat "$WORK/victim")'"

# A lock file removed (to break a claim) while a run waits for it: the run claims the file of
# that name once the holder lets go, not the removed one, which would keep no one out.
mkdir -p "$WORK/U"
flock "$WORK/U/.dt-lock" sleep 4 &
holder=$!
sleep 0.5
timeout -k 10 "$RUN_LIMIT" "$BIN" --config "$CONFIG" --data.path="$TEXT" --train.steps=2 \
  --ckpt.dir="$WORK/U" --ckpt.lock-wait-s=60 >U.out 2>&1 &
waiter=$!
for _ in $(seq 100); do grep -q "is in use by" U.out && break; sleep 0.1; done
rm -f "$WORK/U/.dt-lock"
wait "$holder"
wait "$waiter"
rc=$?
sed 's/^/    /' U.out
[ $rc -eq 0 ] || fail "U: exit code $rc, expected 0"
grep -q "^dt_train on .*, pid [0-9]*, since " "$WORK/U/.dt-lock" 2>/dev/null ||
  fail "U: $WORK/U/.dt-lock does not name the run that claimed the folder: '$(cat "$WORK/U/.dt-lock" 2>&1)'"

# A run that dies (SIGKILL on every rank) leaves no claim behind.
start_held K "$WORK/K" || finish
for r in 0 1; do
  p=$(rank_pid "$WORK/K" "$r")
  [ -n "$p" ] && kill -KILL "$p"
done
wait "$job"
train R 2 --train.steps=3 --ckpt.every=1 --ckpt.dir="$WORK/K"
expect_rc R 0
expect_line R "resumed from .*K/step-2\.h5 at step 2 "
finish
