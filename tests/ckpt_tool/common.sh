# shellcheck shell=bash disable=SC2034
# Sourced by the dt_ckpt test scripts. Every script is called as
#   SCRIPT WORK CKPTS DT_CKPT DT_TRAIN PYTHON CONFIG TEXT [MPIEXEC...] [-- EXTRA...]
# WORK: this test's scratch folder (emptied first); CKPTS: the checkpoints ckpt_tool.setup made
# with dt_train (step-2.h5, step-4.h5); CONFIG, TEXT: dt_train's --config and --data.path.
set -u
NAME=$(basename "$0" .sh)
WORK=$1 CKPTS=$2 DT_CKPT=$3 DT_TRAIN=$4 PY=$5 CONFIG=$6 TEXT=$7
shift 7
MPIEXEC=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do MPIEXEC+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
TOOLS=$(cd "$(dirname "$0")" && pwd)
rm -rf "$WORK" && mkdir -p "$WORK" || { echo "$NAME: FAIL: cannot create $WORK"; exit 1; }
CKPT=$CKPTS/step-4.h5

fail() { echo "$NAME: FAIL: $*"; exit 1; }
pass() { echo "$NAME: PASS: $*"; exit 0; }
# run CMD...: runs it, prints its output, keeps it in OUT and the exit code in RC.
run() {
  echo "+ $*"
  OUT=$("$@" 2>&1)
  RC=$?
  printf '%s\n' "$OUT"
}
expect_rc() { [ "$RC" -eq "$1" ] || fail "exit code $RC, wanted $1 ($2)"; }
expect_line() { printf '%s\n' "$OUT" | grep -Eq -- "$1" || fail "no line matches /$1/"; }
expect_count() {  # expect_count N REGEX: exactly N lines match
  local n
  n=$(printf '%s\n' "$OUT" | grep -Ec -- "$2")
  [ "$n" -eq "$1" ] || fail "$n lines match /$2/, wanted $1"
}
# flip FILE DATASET [DELTA]: changes one byte inside the contiguous data of DATASET (h5ls -va
# prints its file offset as "Address: N"); the byte at N+DELTA gets its bits inverted.
flip() {
  local addr pos old new
  addr=$(h5ls -va "$1$2" | awk '/Address:/ {print $2}')
  [ -n "$addr" ] || fail "h5ls found no address of $2 in $1"
  pos=$((addr + ${3:-100}))
  old=$(od -An -tu1 -j "$pos" -N1 "$1" | tr -d ' ')
  new=$((255 - old))
  printf "\\$(printf '%03o' "$new")" | dd of="$1" bs=1 seek="$pos" conv=notrunc status=none ||
    fail "cannot write $1"
  echo "flipped byte $pos of $1 ($2 at $addr): $old -> $new"
}
