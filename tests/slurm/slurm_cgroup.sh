#!/usr/bin/env bash
# slurm.slurm_cgroup: under a Slurm that confines its jobs itself (scripts/slurm-local up --cgroup:
# proctrack/cgroup, and task/cgroup with ConstrainCores, as most sites run it), a 2-task job of
# tier high trains with both ranks still in the cpuset and memory groups Slurm made for the job:
# the prolog's cpuset group lies outside them, so a rank that moved there would leave Slurm's
# cores, memory limit and accounting. Each rank says why it stays, keeps the CPUs Slurm gave it,
# and enters the prolog's cpu group (the tier's cpu.shares), where Slurm has no group of its own.
# After the job is cancelled the epilog leaves nothing behind. The cluster is this test's own
# (its folder under WORKDIR) and is stopped at the end; the shared one is not used.
source "$(dirname "$0")/lib.sh"
if [ -f "$STATE/unavailable" ]; then
  cat "$STATE/unavailable"
  exit 77
fi
if ! awk '$3 == "cgroup" && $4 ~ /(^|,)cpuset(,|$)/ { found = 1 } END { exit !found }' /proc/mounts
then
  echo "slurm.slurm_cgroup: skipped: no cgroup v1 cpuset hierarchy here (the test reads Slurm's v1 groups)"
  exit 77
fi
export DT_SLURM_DIR=$WORK/slurm
if ! "$DT_ROOT/scripts/slurm-local" up --cgroup >up.out 2>&1; then
  sed 's/^/    /' up.out
  "$DT_ROOT/scripts/slurm-local" down >/dev/null 2>&1
  echo "FAIL: scripts/slurm-local up --cgroup"
  exit 1
fi
tail -n 1 up.out
need_cluster
# The jobs end (their epilogs run) before the cluster stops, so cleanup has none left to wait for.
stop_cluster() {
  local rc=$? j
  for j in "${JOBS[@]}"; do
    scancel "$j" 2>/dev/null
    wait_ended "$j" 60 >/dev/null
  done
  JOBS=()
  "$DT_ROOT/scripts/slurm-local" down >"$WORK/down.out" 2>&1 ||
    { sed 's/^/    /' "$WORK/down.out"; echo "FAIL: scripts/slurm-local down"; rc=1; }
  # Slurm's groups of the host go with the cluster.
  if [ -d "$CS_ROOT/slurm_$(hostname)" ]; then
    echo "FAIL: scripts/slurm-local down left $CS_ROOT/slurm_$(hostname)"
    rc=1
  fi
  (exit $rc)
  cleanup
}
trap stop_cluster EXIT

submit C -n 2 --comment=dt-qos=high -- "$CONFIG" --data.path="$TEXT" --train.steps=1000000 \
  --train.log-every=1000 --train.eval-every=0 --train.log-file="$WORK/C.jsonl"
[ -n "$JOB" ] || finish
wait_lines C.jsonl 3 || finish

# cpus LIST: the CPUs of a list such as 0-3,6, one a line.
cpus() {
  local r
  for r in ${1//,/ }; do seq "${r%-*}" "${r#*-}"; done
}
# within A B: every CPU of list A is in list B (and A is not empty).
within() {
  [ -n "$1" ] && [ -z "$(comm -23 <(cpus "$1" | sort) <(cpus "$2" | sort))" ]
}

PARENT=$(hook_setting DT_QOS_CGROUP_PARENT)
job_ranks "$JOB" 2
CS_ROOT=$(awk '$3 == "cgroup" && $4 ~ /(^|,)cpuset(,|$)/ { print $2; exit }' /proc/mounts)
CPU_ROOT=$(awk '$3 == "cgroup" && $4 ~ /(^|,)cpu(,|$)/ { print $2; exit }' /proc/mounts)
[ -n "$CS_ROOT" ] && [ -n "$CPU_ROOT" ] || fail "no cgroup v1 cpuset and cpu hierarchies mounted"
for p in "${RANKS[@]}"; do
  cs=$(sed -n 's/^[0-9]*:\([^:]*,\)\{0,1\}cpuset\(,[^:]*\)\{0,1\}://p' "/proc/$p/cgroup")
  cpu=$(sed -n 's/^[0-9]*:\([^:]*,\)\{0,1\}cpu\(,[^:]*\)\{0,1\}://p' "/proc/$p/cgroup")
  allowed=$(sed -n 's/^Cpus_allowed_list:\s*//p' "/proc/$p/status")
  echo "rank $p: cpuset $cs (cpus $(cat "$CS_ROOT$cs/cpuset.cpus" 2>/dev/null)), cpu $cpu," \
    "allowed CPUs $allowed"
  case "$cs" in
    */job_"$JOB"/*) [[ "$cs" != */"$PARENT"/* ]] ||
      fail "rank $p left Slurm's cpuset group for the prolog's: $cs" ;;
    *) fail "rank $p is not in a cpuset group of Slurm's job $JOB: '$cs'" ;;
  esac
  within "$allowed" "$(cat "$CS_ROOT$cs/cpuset.cpus" 2>/dev/null)" ||
    fail "rank $p may run on CPUs $allowed, outside $(cat "$CS_ROOT$cs/cpuset.cpus") of Slurm's group"
  [ "$cpu" = "/$PARENT/job_$JOB" ] || fail "rank $p is in cpu group '$cpu', expected /$PARENT/job_$JOB"
done
[ "$(cat "$CPU_ROOT/$PARENT/job_$JOB/cpu.shares" 2>/dev/null)" = 768 ] ||
  fail "$CPU_ROOT/$PARENT/job_$JOB/cpu.shares is not 768 (tier high's weight 75)"
expect_line C "^dt: qos: warning: .*/job_$JOB .*Slurm.*$CS_ROOT/$PARENT/job_$JOB"
[ "$(grep -c "^dt: qos: warning:" C.out)" = 1 ] ||
  fail "expected one warning on the node (the cpuset group; its first rank says it for both)," \
    "got: $(grep "^dt: qos: warning:" C.out)"

scancel "$JOB"
expect_end C "$JOB" CANCELLED
node_healthy
no_job_groups "$JOB"
finish
