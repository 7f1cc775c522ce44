#!/usr/bin/env bash
# train.drain_mid_step: a drain signal that comes during a long step (2000 micro-batches) is said
# at once, naming the step and the micro-batches left, and the run drains after that step
# (exit 76 without a checkpoint folder). With a launcher (mpiexec -n 2 ... --) and options after
# it (--parallel.pp=2), the pipeline schedule's step says it too; SIGUSR1 goes to the launcher,
# which hands it to the ranks.
#   drain_mid_step.sh DT_TRAIN CONFIG TEXT WORKDIR [LAUNCHER... -- DT_TRAIN_OPTIONS...]
set -u
TRAIN=$1 CONFIG=$2 TEXT=$3 WORK=$4
shift 4
LAUNCH=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do LAUNCH+=("$1"); shift; done
[ "${1:-}" = -- ] && shift
SIGNAL=TERM
[ ${#LAUNCH[@]} -eq 0 ] || SIGNAL=USR1
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
${LAUNCH[@]+"${LAUNCH[@]}"} "$TRAIN" --config "$CONFIG" --data.path="$TEXT" --train.batch=16000 \
  --train.micro-batch=8 --train.steps=3 --train.log-every=1 --train.eval-every=0 "$@" \
  >run.out 2>&1 &
pid=$!
# The signal goes during step 2: once step 1's line is out (a step takes seconds, the reaction
# here a tenth of one). However long step 1 takes: the test's timeout bounds the wait.
until grep -qs "^step *1/3" run.out; do
  kill -0 "$pid" 2>/dev/null || { sed 's/^/    /' run.out; echo "FAIL: dt_train ended before step 1"; exit 1; }
  sleep 0.1
done
kill -"$SIGNAL" "$pid"
wait "$pid"
rc=$?
sed 's/^/    /' run.out
[ $rc -eq 76 ] || { echo "FAIL: exit code $rc, expected 76"; exit 1; }
grep -qE "^dt_train: rank [0-9]+: drain signal during step 2: it finishes its [0-9]+ micro-batches left first, then drains$" run.out ||
  { echo "FAIL: no line saying the signal came during step 2"; exit 1; }
grep -q "drained at step 2" run.out || { echo "FAIL: it did not drain after step 2"; exit 1; }
echo "drain_mid_step.sh: PASS"
