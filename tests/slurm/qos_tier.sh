#!/usr/bin/env bash
# slurm.qos_tier: a 2-task job submitted with --comment="run A=b, dt-qos=high" runs in the tier
# the prolog applied, as seen from outside while it trains: the prolog's record names tier high
# (weight 75, FIFO 60); each of the job's groups has the tier's CPU weight (v2 cpu.weight, v1 cpu.shares =
# weight * 1024 / 100) and the cpuset the record names; both ranks are in every group (the group's
# cgroup.procs and the rank's /proc/PID/cgroup); each rank's main (compute) thread is SCHED_OTHER
# and its communication progress thread "dt-progress" SCHED_FIFO at priority 60, its metrics
# threads "dt-metrics" SCHED_BATCH (read from /proc/PID/task/TID/stat). Then a detached process Slurm knows nothing of joins the job's groups,
# and a file named like the job's shared memory is put in /dev/shm; a rank is killed (SIGKILL):
# the job fails, the epilog has killed the stray process (naming it in its log), removed the
# file (and not another job's) and the groups and the record; the node is not drained.
source "$(dirname "$0")/lib.sh"
need_cluster
# The ranks move themselves (dt::qos::configure): slurmstepd's plugin, which would have placed
# them already (slurm.spank), is left out for this test.
use_plugstack "# none: slurm.qos_tier tests the ranks' own move"

submit Q -n 2 "--comment=run A=b, dt-qos=high" -- "$CONFIG" --data.path="$TEXT" --train.steps=1000000 \
  --train.log-every=1000 --train.eval-every=0 --train.log-file="$WORK/Q.jsonl" \
  --metrics.textfile="$WORK/Q-{rank}.prom"
[ -n "$JOB" ] || finish
wait_lines Q.jsonl 5 || { sed 's/^/    /' Q.out; finish; }

STATE_DIR=$(hook_setting DT_QOS_STATE_DIR)
REC=$STATE_DIR/job-$JOB.conf
echo "=== the prolog's record $REC"
sed 's/^/    /' "$REC" || fail "no record $REC"
for kv in tier=high weight=75 fifo=60; do
  grep -qx "$kv" "$REC" || fail "the record lacks $kv"
done
CPUS=$(sed -n 's/^cpus=//p' "$REC")
CGMODE=$(sed -n 's/^mode=//p' "$REC")
[ -n "$CPUS" ] || fail "the record names no CPUs"
mapfile -t GROUPS_ < <(sed -n 's/^cgroup=//p' "$REC")
if [ "$CGMODE" = none ]; then
  echo "slurm.qos_tier: skipped: this machine has no cgroup cpu controller (v1 or v2) to test"
  exit 77
fi
[ ${#GROUPS_[@]} -ge 1 ] || fail "the record names no cgroup (mode $CGMODE)"

job_ranks "$JOB" 2

WEIGHTS=0 CPUSETS=0  # groups whose CPU weight and cpuset were checked
for g in "${GROUPS_[@]}"; do
  echo "--- $g: $(cd "$g" 2>/dev/null && grep -H . cpu.weight cpu.shares cpuset.cpus cpuset.mems 2>/dev/null | tr '\n' ' ')"
  [ -d "$g" ] || { fail "group $g does not exist"; continue; }
  if [ "$CGMODE" = v2 ]; then
    [ "$(cat "$g/cpu.weight")" = 75 ] || fail "$g/cpu.weight is $(cat "$g/cpu.weight"), expected 75"
    WEIGHTS=$((WEIGHTS + 1))
  elif [ -f "$g/cpu.shares" ]; then
    [ "$(cat "$g/cpu.shares")" = 768 ] || fail "$g/cpu.shares is $(cat "$g/cpu.shares"), expected 768"
    WEIGHTS=$((WEIGHTS + 1))
  fi
  if [ -f "$g/cpuset.cpus" ]; then
    [ "$(cat "$g/cpuset.cpus")" = "$CPUS" ] ||
      fail "$g/cpuset.cpus is '$(cat "$g/cpuset.cpus")', the record says '$CPUS'"
    CPUSETS=$((CPUSETS + 1))
  fi
  for p in "${RANKS[@]}"; do
    grep -qx "$p" "$g/cgroup.procs" || fail "rank pid $p is not in $g/cgroup.procs"
  done
done
[ $WEIGHTS -ge 1 ] || fail "no group of the record has a CPU weight (cpu.weight or cpu.shares)"
[ $CPUSETS -ge 1 ] || fail "no group of the record has a cpuset"
for p in "${RANKS[@]}"; do
  grep -q "/$(hook_setting DT_QOS_CGROUP_PARENT)/job_$JOB\$" "/proc/$p/cgroup" ||
    fail "/proc/$p/cgroup names no group of job $JOB: $(tr '\n' ' ' <"/proc/$p/cgroup")"
done

# sched PID TID: "policy rt_priority nice" of a thread (fields 41, 40 and 19 of its stat file).
sched() {
  sed 's/^.*) //' "/proc/$1/task/$2/stat" 2>/dev/null | awk '{ print $39, $38, $17 }'
}
# expect_threads PID NAME POLICY [PRIORITY]: PID has a thread named NAME, and each such thread
# has scheduling policy POLICY (0 SCHED_OTHER, 1 SCHED_FIFO, 3 SCHED_BATCH) and, if given,
# real-time priority PRIORITY.
expect_threads() {
  local p=$1 name=$2 want_pol=$3 want_prio=${4:-} found=0 t pol prio nice
  for t in /proc/"$p"/task/*; do
    [ "$(cat "$t/comm" 2>/dev/null)" = "$name" ] || continue
    found=1
    read -r pol prio nice <<<"$(sched "$p" "${t##*/}")"
    echo "rank $p $name thread ${t##*/}: policy $pol priority $prio nice $nice"
    if [ "$pol" != "$want_pol" ] || { [ -n "$want_prio" ] && [ "$prio" != "$want_prio" ]; }; then
      fail "rank $p: $name has policy $pol priority $prio, expected policy $want_pol${want_prio:+ priority $want_prio}"
    fi
  done
  [ $found -eq 1 ] ||
    fail "rank $p has no thread named $name (threads: $(cat /proc/"$p"/task/*/comm | sort | uniq -c | tr -s ' \n' ' '))"
}
for p in "${RANKS[@]}"; do
  read -r pol prio nice <<<"$(sched "$p" "$p")"
  echo "rank $p main thread: policy $pol priority $prio nice $nice"
  [ "$pol" = 0 ] || fail "rank $p: the main (compute) thread has policy $pol, expected 0 (SCHED_OTHER)"
  expect_threads "$p" dt-progress 1 60  # SCHED_FIFO at the tier's priority
  expect_threads "$p" dt-metrics 3      # SCHED_BATCH
done

# A process in the job's groups that Slurm does not know of (started outside the job, detached):
# what a rank lost by proctrack/linuxproc looks like. The epilog must not let it outlive the job.
setsid sleep 600 </dev/null >/dev/null 2>&1 &
STRAY=$!
for g in "${GROUPS_[@]}"; do echo "$STRAY" >"$g/cgroup.procs" || fail "cannot move $STRAY into $g"; done
echo "=== a stray process $STRAY in the job's groups"
# What a rank killed while mapping its shared memory leaves (the name of a segment of this job).
SHM_LEFT=/dev/shm/dt-shm-j$JOB-999999-0
: >"$SHM_LEFT" || fail "cannot create $SHM_LEFT"
SHM_OTHER=/dev/shm/dt-shm-j${JOB}0-999999-0  # another job's (whose id starts with this one's)
: >"$SHM_OTHER" || fail "cannot create $SHM_OTHER"

echo "=== killing rank ${RANKS[0]} (SIGKILL): a crashed job"
kill -KILL "${RANKS[0]}" 2>/dev/null || fail "could not kill ${RANKS[0]}"
expect_end Q "$JOB" FAILED
grep "job=$JOB:" "$(hook_setting DT_QOS_LOG)" | sed 's/^/    /'
node_healthy
for _ in $(seq 1 50); do kill -0 "$STRAY" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$STRAY" 2>/dev/null && [ "$(cat "/proc/$STRAY/stat" 2>/dev/null | awk '{print $3}')" != Z ]; then
  fail "the stray process $STRAY of the job's groups outlived the job"
  kill -KILL "$STRAY" 2>/dev/null
fi
grep -q "job=$JOB: killing leftover process $STRAY (sleep)" "$(hook_setting DT_QOS_LOG)" ||
  fail "the epilog's log does not name the stray process $STRAY it killed"
[ ! -e "$SHM_LEFT" ] || fail "the epilog left $SHM_LEFT of job $JOB"
[ -e "$SHM_OTHER" ] || fail "the epilog of job $JOB removed $SHM_OTHER of another job"
rm -f "$SHM_LEFT" "$SHM_OTHER"
no_job_groups "$JOB"
for g in "${GROUPS_[@]}"; do [ ! -e "$g" ] || fail "$g still exists"; done
finish
