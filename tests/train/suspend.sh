#!/usr/bin/env bash
# train.watchdog_suspend: a job stopped longer than comm.timeout-s and then continued (what
# `scontrol suspend` and `scontrol resume` do: SIGSTOP and SIGCONT to every process) is no hang.
# The job holds after step 2, its ranks asking each other every 20 ms whether to drain. Rank 1 is
# stopped first, so rank 0 waits for it inside a collective; a second later rank 0 is stopped too;
# 6 s later (twice the 3 s timeout) both continue. The watchdog must not fire, and a drain signal
# then ends the job as usual (exit 76: drained, with no ckpt.dir to save in).
#   suspend.sh CMD...   (CMD: an mpiexec of dt_train on 2 ranks)
set -u
log=$(mktemp)
trap 'rm -f "$log"' EXIT
setsid "$@" --train.steps=5 --test.hold-at-step=2 --comm.timeout-s=3 >"$log" 2>&1 &
job=$!
fail() {
  echo "suspend.sh: FAIL: $*"
  cat "$log"
  pkill -KILL -s "$job" 2>/dev/null
  exit 1
}
# The rank of dt_train process $1 (Open MPI puts it in the environment).
rank_of() { tr '\0' '\n' <"/proc/$1/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p'; }
for _ in $(seq 600); do
  grep -q "waiting for a drain signal" "$log" && break
  kill -0 "$job" 2>/dev/null || fail "the job ended before it held"
  sleep 0.1
done
grep -q "waiting for a drain signal" "$log" || fail "the job never held at step 2"
r0="" r1=""
for p in $(pgrep -s "$job" -x dt_train); do
  case $(rank_of "$p") in 0) r0=$p ;; 1) r1=$p ;; esac
done
[ -n "$r0" ] && [ -n "$r1" ] || fail "ranks 0 and 1 not found among $(pgrep -s "$job" -x dt_train | tr '\n' ' ')"
kill -STOP "$r1"
sleep 1
kill -STOP "$r0"
sleep 6
kill -CONT "$r0" "$r1"
sleep 2  # the watchdog of each rank has looked again
kill -0 "$job" 2>/dev/null || fail "the job ended after the suspension"
kill -USR1 "$r0"
wait "$job"
rc=$?
grep -q "^dt watchdog" "$log" && fail "the watchdog called the suspension a hang"
[ "$rc" -eq 76 ] || fail "exit code $rc after the drain signal, expected 76 (no ckpt.dir)"
grep -q "drained at step 2" "$log" || fail "no drain at step 2"
echo "suspend.sh: PASS: stopped for 6 s with a 3 s timeout, drained afterwards"
