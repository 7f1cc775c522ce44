#!/usr/bin/env bash
# train.bad.plan_dot: --print-plan's --plan.dot. A file there that is not a DOT graph (the
# training data named by mistake) is refused (exit 2) before the plan, and left byte for byte; a
# folder that cannot take the file is refused before the plan is printed; a folder is refused;
# an earlier plan's file is replaced by the new plan.
#   plan_dot.sh DT_TRAIN CONFIG TEXT WORKDIR
set -u
TRAIN=$1 CONFIG=$2 TEXT=$3 WORK=$4
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
# plan NAME DOT [DATA]: dt_train --print-plan with --plan.dot=DOT into NAME.out; RC its exit code.
plan() {
  "$TRAIN" --config "$CONFIG" --data.path="${3:-$TEXT}" --print-plan --plan.dot="$2" >"$1.out" 2>&1
  RC=$?
  echo "=== $1: --plan.dot=$2: exit code $RC"
  sed 's/^/    /' "$1.out" | grep -v '^    rank\|^     ' | head -8
}
cp "$TEXT" data.txt
plan data data.txt data.txt
[ $RC -eq 2 ] || fail "data: exit code $RC, expected 2"
grep -q "option --plan.dot: data.txt exists and is not a Graphviz DOT graph" data.out ||
  fail "data: no refusal naming data.txt"
grep -q "dt_train: plan:" data.out && fail "data: the plan was made before the refusal"
cmp -s "$TEXT" data.txt || fail "data.txt was changed"

plan nofolder /nonexistent/p.dot
[ $RC -eq 2 ] || fail "nofolder: exit code $RC, expected 2"
grep -q "option --plan.dot: cannot write /nonexistent/p.dot (making a file in /nonexistent: No such file or directory)" nofolder.out ||
  fail "nofolder: no refusal naming the folder"
grep -q "dt_train: plan:" nofolder.out && fail "nofolder: the plan was printed before the refusal"

mkdir adir
plan folder adir
[ $RC -eq 2 ] || fail "folder: exit code $RC, expected 2"
grep -q "option --plan.dot: adir is a folder" folder.out || fail "folder: no refusal naming it"

plan first p.dot
[ $RC -eq 0 ] || fail "first: exit code $RC"
head -c 8 p.dot | grep -q '^digraph ' || fail "p.dot is not a DOT graph"
echo "digraph \"old\" {}" >p.dot
plan again p.dot
[ $RC -eq 0 ] || fail "again: exit code $RC"
grep -q "dt plan" p.dot || fail "the earlier plan's file was not replaced"
[ "$(ls -A | grep -c tmp)" = 0 ] || fail "temporary files left: $(ls -A)"
[ $FAILED -eq 0 ] && echo "plan_dot.sh: PASS"
exit $FAILED
