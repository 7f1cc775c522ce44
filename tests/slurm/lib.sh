# shellcheck shell=bash
# Common helpers of the Slurm tests (sourced, not run).
#
# Every test script is called as
#   SCRIPT WORKDIR DT_ROOT DT_BIN_DIR STATE_DIR MODE MPIEXEC...
# WORKDIR is the test's own directory (emptied first, removed at the end unless DT_KEEP_TEST_DIR
# is set), STATE_DIR the fixture's (tests/slurm/fixture.sh), MODE a variant ("-" for none).
# Jobs a test submits are cancelled at its end if still there, and waited for, so that their
# epilogs have run before the next test.
set -u

[ $# -ge 6 ] || { echo "usage: $0 WORKDIR DT_ROOT DT_BIN_DIR STATE_DIR MODE MPIEXEC..." >&2; exit 2; }
WORK=$1
DT_ROOT=$2
BIN_DIR=$3
STATE=$4
MODE=$5
shift 5
MPIEXEC=("$@")
STEPLOG="python3 $DT_ROOT/tests/ckpt/steplog.py"
CONFIG=$DT_ROOT/configs/micro.ini
TEXT=/usr/share/common-licenses/GPL-3
SBATCH_SCRIPT=$DT_ROOT/slurm/train.sbatch
# Seconds a job may take from submission to its end (they take a few, plus the requeue delay).
JOB_LIMIT=${DT_SLURM_JOB_LIMIT:-150}
JOBS=()

rm -rf "$WORK"
mkdir -p "$WORK" || exit 1
cd "$WORK" || exit 1

FAILED=0
fail() {
  echo "FAIL: $*"
  FAILED=1
}

cleanup() {
  local rc=$? j
  restore_plugstack
  for j in "${JOBS[@]}"; do
    case "$(job_state "$j")" in
      PENDING | RUNNING | REQUEUED | REQUEUE_HOLD | REQUEUE_FED | SUSPENDED | CONFIGURING)
        echo "cleanup: cancelling job $j"
        scancel "$j" 2>/dev/null
        ;;
    esac
  done
  for j in "${JOBS[@]}"; do wait_ended "$j" 60 >/dev/null; done
  if [ -n "${DT_KEEP_TEST_DIR:-}" ]; then
    echo "(kept $WORK)"
  else
    rm -rf "$WORK"
  fi
  exit $rc
}

# use_plugstack TEXT: the cluster's plugstack.conf (read by slurmstepd at each step's start) holds
# TEXT until restore_plugstack, which cleanup calls however the test ends.
PLUGSTACK_SAVED=""
use_plugstack() {
  local f
  f=$(dirname "$SLURM_CONF")/plugstack.conf
  if [ -z "$PLUGSTACK_SAVED" ]; then
    PLUGSTACK_SAVED=$(cat "$f") || fail "cannot read $f"
  fi
  printf '%s\n' "$1" >"$f"
}
restore_plugstack() {
  [ -n "$PLUGSTACK_SAVED" ] || return 0
  printf '%s\n' "$PLUGSTACK_SAVED" >"$(dirname "$SLURM_CONF")/plugstack.conf"
  PLUGSTACK_SAVED=""
}

finish() {
  if [ "$FAILED" -ne 0 ]; then
    echo "$(basename "$0") $MODE: FAIL"
    exit 1
  fi
  echo "$(basename "$0") $MODE: PASS"
  exit 0
}

# need_cluster: skips (77) when the fixture found no Slurm; fails when the cluster is not up.
need_cluster() {
  if [ -f "$STATE/unavailable" ]; then
    cat "$STATE/unavailable"
    exit 77
  fi
  eval "$("$DT_ROOT/scripts/slurm-local" env)"
  export SLURM_CONF
  if ! "$DT_ROOT/scripts/slurm-local" status >status.out 2>&1; then
    cat status.out
    echo "FAIL: the local Slurm is not up (run scripts/slurm-local up, or ctest with the slurm.up fixture)"
    exit 1
  fi
  trap cleanup EXIT
  NODE=$(sinfo -h -o %N | head -n1)
  export DT_BIN=$BIN_DIR
}

# job_field JOB KEY: KEY's value in `scontrol show job -o JOB` ("" when none).
job_field() {
  scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n1
}
job_state() { job_field "$1" JobState; }

# submit NAME SBATCH_ARGS... -- SCRIPT_ARGS...: sbatch slurm/train.sbatch with output in
# NAME.out; the job id in $JOB (empty, with a failure, when sbatch refused).
submit() {
  local name=$1 sargs=() out
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do sargs+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  echo "=== $name: sbatch ${sargs[*]} slurm/train.sbatch $*"
  if out=$(sbatch --parsable -o "$WORK/$name.out" "${sargs[@]}" "$SBATCH_SCRIPT" "$@" 2>&1); then
    JOB=${out%%;*}
    JOBS+=("$JOB")
    echo "=== $name: job $JOB"
  else
    JOB=""
    echo "$out"
    fail "$name: sbatch refused the job"
  fi
}

# wait_ended JOB [SECONDS]: waits until JOB is COMPLETED, FAILED, CANCELLED, TIMEOUT, ...; prints
# the final state. Fails (and prints TIMEDOUT_WAIT) when it does not end in time.
wait_ended() {
  local j=$1 limit=${2:-$JOB_LIMIT} t0=$SECONDS s
  while :; do
    s=$(job_state "$j")
    if is_ended "$s"; then
      echo "$s"
      return 0
    fi
    if [ $((SECONDS - t0)) -ge "$limit" ]; then
      echo "TIMEDOUT_WAIT($s)"
      return 1
    fi
    sleep 0.5
  done
}

# wait_state JOB STATE [SECONDS]: waits until JOB is in STATE.
wait_state() {
  local j=$1 want=$2 limit=${3:-$JOB_LIMIT} t0=$SECONDS
  while [ "$(job_state "$j")" != "$want" ]; do
    if [ $((SECONDS - t0)) -ge "$limit" ]; then
      fail "job $j not $want after $limit s (state $(job_state "$j"))"
      return 1
    fi
    sleep 0.2
  done
}

# expect_end NAME JOB STATE: the job ends in STATE; its output is shown.
expect_end() {
  local got
  got=$(wait_ended "$2")
  echo "=== $1: job $2 ended $got, exit code $(job_field "$2" ExitCode), restarts $(job_field "$2" Restarts)"
  sed 's/^/    /' "$1.out" 2>/dev/null
  [ "$got" = "$3" ] || fail "$1: job $2 ended $got, expected $3"
}

# is_ended STATE: STATE is one a job does not leave by itself.
is_ended() {
  case "$1" in
    COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE | PREEMPTED) return 0 ;;
  esac
  return 1
}

# wait_lines FILE N [SECONDS]: FILE has at least N lines; gives up after SECONDS, or at once when
# job $JOB (if set) has ended without writing them.
# On failure it shows why: the job's state and output (NAME.out for NAME.jsonl), the queue, and
# the backtraces of any core files (show_cores, where the multi-node helpers define it: the
# retry of a known Open MPI crash reads them).
wait_lines() {
  local t0=$SECONDS why="" polls=0
  while ! { [ -f "$1" ] && [ "$(wc -l <"$1")" -ge "$2" ]; }; do
    if [ $((SECONDS - t0)) -ge "${3:-$JOB_LIMIT}" ]; then
      why="after ${3:-$JOB_LIMIT} s"
    elif [ -n "${JOB:-}" ] && [ $((++polls % 10)) -eq 0 ] && is_ended "$(job_state "$JOB")"; then
      # The job's last lines may land just before its end is seen: look once more.
      [ -f "$1" ] && [ "$(wc -l <"$1")" -ge "$2" ] && break
      why="when job $JOB ended"
    fi
    if [ -n "$why" ]; then
      fail "$1 has fewer than $2 lines $why"
      if [ -n "${JOB:-}" ]; then
        echo "    job $JOB: $(scontrol show job -o "$JOB" 2>&1 | tr ' ' '\n' |
          grep -E '^(JobState|Reason|NodeList|RunTime|ExitCode)=' | tr '\n' ' ')"
      fi
      [ -f "${1%.jsonl}.out" ] && sed 's/^/    /' "${1%.jsonl}.out"
      squeue -a 2>&1 | sed 's/^/    /'
      if declare -F show_cores >/dev/null; then show_cores; fi
      return 1
    fi
    sleep 0.1
  done
}

expect_line() { grep -Eq -- "$2" "$1.out" || fail "$1: no output line matches /$2/"; }
expect_no_line() { ! grep -Eq -- "$2" "$1.out" || fail "$1: unexpected output line matching /$2/"; }

steplog() { $STEPLOG "$@" || fail "steplog.py $*"; }

# node_healthy: the node is up and not drained (a failing prolog or epilog drains it).
node_healthy() {
  local s
  s=$(sinfo -h -n "$NODE" -o %T | head -n1)
  case "$s" in
    idle* | mixed* | allocated* | completing*) echo "node $NODE: $s" ;;
    *) fail "node $NODE is '$s' (a prolog or epilog failed?): $(sinfo -h -n "$NODE" -o '%T %E')" ;;
  esac
}

# job_ranks JOB N: RANKS, the pids of JOB's dt_train processes (found by SLURM_JOB_ID in their
# environment); fails unless there are N.
job_ranks() {
  local p
  RANKS=()
  for p in $(pgrep -x dt_train); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "SLURM_JOB_ID=$1" && RANKS+=("$p")
  done
  echo "=== ranks of job $1: ${RANKS[*]}"
  [ ${#RANKS[@]} -eq "$2" ] || fail "found ${#RANKS[*]} dt_train processes of job $1, expected $2"
}

# qos_state_dir / cgroup_root: what the cluster's prolog uses (its generated wrapper).
hook_setting() {
  sed -n "s/^export $1='\\(.*\\)'\$/\\1/p" "$(dirname "$SLURM_CONF")/hooks/prolog"
}

# no_job_groups JOB: no cgroup and no record of JOB remain anywhere the prolog may have made them.
no_job_groups() {
  local root left
  root=$(hook_setting DT_QOS_CGROUP_ROOT)
  left=$(find "$root" -maxdepth 4 -type d -path "*/$(hook_setting DT_QOS_CGROUP_PARENT)/job_$1" \
    2>/dev/null | tr '\n' ' ')
  [ -z "$left" ] || fail "cgroups of job $1 left behind: $left"
  [ ! -e "$(hook_setting DT_QOS_STATE_DIR)/job-$1.conf" ] ||
    fail "QoS record of job $1 left behind: $(hook_setting DT_QOS_STATE_DIR)/job-$1.conf"
}

# reference NAME STEPS ARGS...: an uninterrupted 2-rank run (REF_RANKS ranks) under mpiexec, step
# log NAME.jsonl.
reference() {
  local name=$1 steps=$2
  shift 2
  echo "=== $name: uninterrupted reference, mpiexec -n ${REF_RANKS:-2} dt_train --train.steps=$steps $*"
  timeout -k 10 120 "${MPIEXEC[@]}" -n "${REF_RANKS:-2}" "$BIN_DIR/dt_train" --config "$CONFIG" \
    --data.path="$TEXT" --train.steps="$steps" --train.log-file="$WORK/$name.jsonl" "$@" \
    --qos.file=none >"$name.out" 2>&1
  local rc=$?
  tail -n 3 "$name.out" | sed 's/^/    /'
  [ "$rc" -eq 0 ] || { sed 's/^/    /' "$name.out"; fail "$name: exit code $rc"; }
}
