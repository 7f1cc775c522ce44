# Common helpers of the checkpoint end-to-end tests (sourced, not run).
#
# Every test script is called as
#   SCRIPT WORKDIR DT_TRAIN CONFIG TEXT MODE MPIEXEC...
# WORKDIR is the test's own directory (emptied first, removed at the end unless DT_KEEP_TEST_DIR
# is set), MODE selects a variant ("-" for none) and MPIEXEC... is the launcher with its options.
set -u

[ $# -ge 6 ] || { echo "usage: $0 WORKDIR DT_TRAIN CONFIG TEXT MODE MPIEXEC..." >&2; exit 2; }
WORK=$1
BIN=$2
CONFIG=$3
TEXT=$4
MODE=$5
shift 5
MPIEXEC=("$@")
RANKS=2  # of the runs resumes_like_uninterrupted makes (a script may set it after sourcing this)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STEPLOG="python3 $HERE/steplog.py"
# Seconds any one dt_train job may take before it counts as hung (they take about one).
RUN_LIMIT=${DT_CKPT_RUN_LIMIT:-90}

rm -rf "$WORK"
mkdir -p "$WORK" || exit 1
cleanup() {
  local rc=$?
  if [ -n "${DT_KEEP_TEST_DIR:-}" ]; then
    echo "(kept $WORK)"
  else
    rm -rf "$WORK"
  fi
  exit $rc
}
trap cleanup EXIT
cd "$WORK" || exit 1

FAILED=0
fail() {
  echo "FAIL: $*"
  FAILED=1
}
# The end of every script: the verdict.
finish() {
  if [ "$FAILED" -ne 0 ]; then
    echo "$(basename "$0") $MODE: FAIL"
    exit 1
  fi
  echo "$(basename "$0") $MODE: PASS"
  exit 0
}

# train NAME RANKS ARGS...: runs dt_train on RANKS ranks with the micro config and the training
# text; output in NAME.out (also echoed), exit code in $RC.
train() {
  local name=$1 ranks=$2
  shift 2
  echo "=== $name: $ranks ranks: dt_train $*"
  local t0=$SECONDS
  timeout -k 10 "$RUN_LIMIT" "${MPIEXEC[@]}" -n "$ranks" "$BIN" --config "$CONFIG" \
    --data.path="$TEXT" "$@" >"$name.out" 2>&1
  RC=$?
  sed 's/^/    /' "$name.out"
  echo "=== $name: exit code $RC after $((SECONDS - t0)) s"
  # 124: timeout's verdict; 137 after the limit: killed by timeout -k (a job killed by a rank's
  # SIGKILL also ends with 137, but early).
  if [ "$RC" -eq 124 ] || { [ "$RC" -eq 137 ] && [ $((SECONDS - t0)) -ge "$RUN_LIMIT" ]; }; then
    fail "$name: timed out after $RUN_LIMIT s (hang?)"
  fi
}

# expect_rc NAME WANT: the exit code of the last train() must be WANT ("nonzero": any failure).
expect_rc() {
  if [ "$2" = nonzero ]; then
    [ "$RC" -ne 0 ] || fail "$1: exit code 0, expected a failure"
  else
    [ "$RC" -eq "$2" ] || fail "$1: exit code $RC, expected $2"
  fi
}

# expect_line NAME REGEX: NAME.out has a line matching the extended regex.
expect_line() {
  grep -Eq -- "$2" "$1.out" || fail "$1: no output line matches /$2/"
}
# expect_no_line NAME REGEX
expect_no_line() {
  if grep -Eq -- "$2" "$1.out"; then fail "$1: unexpected output line matching /$2/"; fi
}

# expect_file PATH / expect_no_file PATH
expect_file() { [ -f "$1" ] || fail "$1 is missing"; }
expect_no_file() { [ ! -e "$1" ] || fail "$1 should not exist"; }

# expect_latest DIR NAME: DIR/latest names NAME.
expect_latest() {
  local got
  got=$(head -n1 "$1/latest" 2>/dev/null)
  [ "$got" = "$2" ] || fail "$1/latest holds '$got', expected '$2'"
}

# files_in DIR: the sorted names in DIR on one line.
# (Not .dt-lock: the file of a run's claim on the folder, which every run that writes it leaves.)
files_in() { (cd "$1" 2>/dev/null && ls -A | grep -vx '\.dt-lock' | sort | tr '\n' ' ' | sed 's/ $//'); }

# rank_pid DIR RANK: the process of rank RANK of the dt_train run whose --ckpt.dir is DIR (a
# command line that starts with the dt_train binary and names DIR: not mpiexec, not other tests'
# runs).
rank_pid() { rank_pid_of "--ckpt\.dir=$1( |\$)" "$2"; }
# rank_pid_of REGEX RANK: the same for a command line that matches REGEX after the binary. Looks
# again for up to 5 s (a rank's process may not be listed yet on a loaded machine); when none is
# found it prints nothing, and on stderr the processes that matched REGEX with their ranks.
rank_pid_of() {
  local p r try seen
  for try in $(seq 50); do
    seen=""
    for p in $(pgrep -f -- "^$BIN .*$1"); do
      r=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null |
          sed -n 's/^\(OMPI_COMM_WORLD_RANK\|PMIX_RANK\|PMI_RANK\)=//p' | head -n1)
      [ "$r" = "$2" ] && { echo "$p"; return; }
      seen+=" $p(rank '${r}')"
    done
    [ "$try" -lt 50 ] && sleep 0.1
  done
  echo "rank_pid_of: no rank $2 among the processes matching /^$BIN .*$1/:${seen:- none}" >&2
}

# resumes_like_uninterrupted FROM TO ARGS...: a run N on RANKS ranks (2 unless set) into D (ARGS: its
# other options) resumes from D/step-FROM.h5 and trains steps FROM+1..TO as the uninterrupted run U
# (U.jsonl) did; latest then names step-TO.h5.
resumes_like_uninterrupted() {
  local from=$1 to=$2
  shift 2
  train N "$RANKS" --train.steps="$to" --ckpt.dir=D --train.log-file=N.jsonl "$@"
  expect_rc N 0
  expect_line N "resumed from .*D/step-$from\.h5 at step $from "
  steplog steps N.jsonl $((from + 1)) "$to"
  steplog same U.jsonl N.jsonl $((from + 1)) "$to" 1e-5
  expect_latest D "step-$to.h5"
}

# steplog ARGS...: runs steplog.py; a failure counts as a test failure.
steplog() {
  $STEPLOG "$@" || fail "steplog.py $*"
}

# flip_byte FILE OFFSET: overwrites the byte at OFFSET with a different value (its complement).
flip_byte() {
  local file=$1 off=$2 cur new
  cur=$(od -An -tu1 -j "$off" -N1 "$file" | tr -d ' ')
  [ -n "$cur" ] || { fail "cannot read byte $off of $file"; return; }
  new=$((255 - cur))
  # shellcheck disable=SC2059
  printf "\\$(printf '%03o' "$new")" | dd of="$file" bs=1 seek="$off" count=1 conv=notrunc 2>/dev/null
  local now
  now=$(od -An -tu1 -j "$off" -N1 "$file" | tr -d ' ')
  echo "flipped byte $off of $file: $cur -> $now"
  [ "$now" = "$new" ] || fail "byte $off of $file is $now after writing $new"
}

# data_address FILE DATASET: the file offset of a contiguous dataset's raw data.
data_address() {
  local a=""
  if command -v h5ls >/dev/null; then
    a=$(h5ls -va "$1$2" 2>/dev/null | awk '/Address:/ { print $2; exit }')
  fi
  if [ -z "$a" ] && command -v h5dump >/dev/null; then
    a=$(h5dump -p -H -d "$2" "$1" 2>/dev/null | awk '$1 == "OFFSET" { print $2; exit }')
  fi
  echo "$a"
}

# expect_report NAME FILE_REGEX TEXT...: some line of NAME.out matches FILE_REGEX (the damaged
# file, by name), and that line with the 4 after it contains every TEXT (fixed strings).
expect_report() {
  local name=$1 re=$2
  shift 2
  if ! awk -v re="$re" -v want="$(printf '%s\037' "$@")" '
      { line[NR] = $0 }
      END {
        n = split(want, w, "\037")
        for (i = 1; i <= NR; ++i) {
          if (line[i] !~ re) continue
          text = ""
          for (j = i; j <= NR && j <= i + 4; ++j) text = text "\n" line[j]
          ok = 1
          for (k = 1; k <= n; ++k) if (w[k] != "" && index(text, w[k]) == 0) ok = 0
          if (ok) exit 0
        }
        exit 1
      }' "$name.out"; then
    fail "$name: no report of /$re/ that mentions: $*"
  fi
}

# eval_loss NAME: the loss of the "eval-only: step N ... loss X" line of NAME.out ("" if none).
eval_loss() {
  sed -n 's/.*eval-only: step [0-9][0-9]*,.* loss \([-0-9.eE+naif]*\).*/\1/p' "$1.out" | head -n1
}
