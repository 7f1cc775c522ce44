#!/usr/bin/env bash
# train.drain_mid_step{,_pipeline,_finished}: a drain signal that comes during a long step (2000
# micro-batches) is said at once. Where the step is given up (EXPECT given-up: the fused model on
# one rank; two pipeline stages, which read the vote the stage took 2 micro-batches later and say
# so), it is, at a micro-batch boundary, and the run drains as of step 1. Where it is finished
# (EXPECT finished: --train.drain-within-step=false), the line names the micro-batches left, and
# the run drains after step 2. Exit 76 without a checkpoint folder. With a launcher (mpiexec -n 2
# ... --) and options after it (--parallel.pp=2), SIGUSR1 goes to the launcher, which hands it to
# the ranks.
#   drain_mid_step.sh DT_TRAIN CONFIG TEXT WORKDIR given-up|finished [[LAUNCHER...] -- OPTIONS...]
# (options need the --, also without a launcher)
set -u
TRAIN=$1 CONFIG=$2 TEXT=$3 WORK=$4 EXPECT=$5
shift 5
case "$EXPECT" in given-up | finished) ;; *) echo "unknown EXPECT '$EXPECT'"; exit 2 ;; esac
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
# The signal goes during step 2: 0.3 s after step 1's line is out (a step takes seconds), past the
# drain check before step 2. However long step 1 takes: the test's timeout bounds the wait.
until grep -qs "^step *1/3" run.out; do
  kill -0 "$pid" 2>/dev/null || { sed 's/^/    /' run.out; echo "FAIL: dt_train ended before step 1"; exit 1; }
  sleep 0.1
done
sleep 0.3
kill -"$SIGNAL" "$pid"
wait "$pid"
rc=$?
sed 's/^/    /' run.out
[ $rc -eq 76 ] || { echo "FAIL: exit code $rc, expected 76"; exit 1; }
if [ "$EXPECT" = given-up ]; then
  # One wording each: a pipeline's ranks give the step up where they read the vote.
  case " $* " in
    *" --parallel.pp="[2-9]*) at="when the pipeline's vote is read, after at most [0-9]+ of its micro-batches" ;;
    *) at="at this micro-batch boundary" ;;
  esac
  grep -qE "^dt_train: rank [0-9]+: drain signal during step 2: the step is given up $at\$" run.out ||
    { echo "FAIL: no line saying the signal came during step 2 and the step is given up $at"; exit 1; }
  k=$(sed -nE 's/^dt_train: step 2 given up after ([0-9]+) of its 2000 micro-batches, for a drain: .*drains as of step 1$/\1/p' run.out)
  [ -n "$k" ] && [ "$k" -gt 0 ] && [ "$k" -lt 2000 ] ||
    { echo "FAIL: no line saying step 2 was given up after 1 to 1999 micro-batches"; exit 1; }
  grep -q "drained at step 1 " run.out || { echo "FAIL: it did not drain as of step 1"; exit 1; }
else
  grep -qE "^dt_train: rank [0-9]+: drain signal during step 2: it finishes its [0-9]+ micro-batches left first, then drains$" run.out ||
    { echo "FAIL: no line saying the signal came during step 2"; exit 1; }
  grep -q "drained at step 2 " run.out || { echo "FAIL: it did not drain after step 2"; exit 1; }
fi
echo "drain_mid_step.sh $EXPECT: PASS"
