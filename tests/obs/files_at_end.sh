#!/usr/bin/env bash
# obs.files_at_end: what a run writes at its end, in the runs that end differently.
#   A: 2 ranks train 4 steps without a validation split (data.val-fraction=0): the textfile holds
#      the training series but no dt_train_val_loss (nothing was evaluated: none is exported).
#   B: --eval-only of A's checkpoint with --trace.dir and --metrics.textfile: each rank writes
#      its timeline (valid JSON) and its textfile, whose dt_train_val_loss is the printed loss.
#   files_at_end.sh WORKDIR DT_TRAIN DT_TRACE CONFIG TEXT MPIEXEC...
set -u
WORK=$1 BIN=$2 CONFIG=$4 TEXT=$5
shift 5
MPIEXEC=("$@")
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
[ -n "${DT_KEEP_TEST_DIR:-}" ] || trap 'cd /; rm -rf "$WORK"' EXIT
fail=0
FAIL() { echo "FAIL: $*"; fail=1; }
run() {  # run NAME ARGS...
  local name=$1
  shift
  timeout -k 5 120 "${MPIEXEC[@]}" -n 2 "$BIN" --config "$CONFIG" --data.path="$TEXT" "$@" \
    >"$name.out" 2>&1
  RC=$?
  sed 's/^/    /' "$name.out"
  echo "=== $name: exit code $RC"
}
run A --train.steps=4 --data.val-fraction=0 --ckpt.dir=C --metrics.textfile="$WORK/a-{rank}.prom"
[ "$RC" -eq 0 ] || FAIL "A failed"
for r in 0 1; do
  [ -f "a-$r.prom" ] || { FAIL "a-$r.prom is missing"; continue; }
  grep -q '^dt_train_step{.*} 4$' "a-$r.prom" || FAIL "a-$r.prom: no dt_train_step 4"
  grep -q '^dt_train_val_loss' "a-$r.prom" && FAIL "a-$r.prom exports dt_train_val_loss without an evaluation"
done
run B --eval-only --ckpt.resume="$WORK/C/step-4.h5" --eval.sequences=4 \
  --trace.dir="$WORK/T" --metrics.textfile="$WORK/b-{rank}.prom"
[ "$RC" -eq 0 ] || FAIL "B failed"
loss=$(sed -n 's/.*eval-only: step 4, .* loss \([0-9.]*\)$/\1/p' B.out)
[ -n "$loss" ] || FAIL "B printed no eval-only loss"
for r in 0 1; do
  python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "T/trace-rank$r.json" 2>/dev/null ||
    FAIL "T/trace-rank$r.json is missing or not JSON"
  [ -f "b-$r.prom" ] || { FAIL "b-$r.prom is missing"; continue; }
  got=$(sed -n 's/^dt_train_val_loss{.*} //p' "b-$r.prom")
  [ -n "$loss" ] && [ -n "$got" ] && awk -v a="$got" -v b="$loss" 'BEGIN{exit !((a-b)^2 < 1e-12)}' ||
    FAIL "b-$r.prom: dt_train_val_loss '$got', the run printed '$loss'"
done
[ "$fail" -eq 0 ] && echo "files_at_end.sh: PASS" || echo "files_at_end.sh: FAIL"
exit "$fail"
