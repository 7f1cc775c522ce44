#!/usr/bin/env bash
# slurm.prolog_tree_v2 / slurm.prolog_tree_v1 (MODE v2, v1): slurm/prolog and slurm/epilog on a
# temporary cgroup tree laid out like a cgroup v2 (unified, cpu and cpuset controllers) or v1
# (cpu, cpuacct, cpuset hierarchies) mount, with two NUMA nodes: the tier of the job's comment
# (or the default) gets its weight, cpuset and FIFO priority; an unknown tier falls back to
# best_effort with a line in the log; every prolog exits 0, also without a config or a cgroup
# controller; the epilog removes the groups and records, also when the record is missing (a
# prolog that died); dt_train reads a record, joins its group and reports the tier. qos.ini as
# dt reads configs: numbers with leading zeros are decimal (08, 025), CRLF line ends and comments
# after a value (" # ...") are taken; a value out of range or malformed gets a log line naming the
# file, the key and the value, and the job its record with the fallback. With comment = lower in
# [default], a comment naming a tier above the job's tier without it (Slurm QOS, else [default])
# is logged and that tier applies; an unknown value of comment is logged and acts as lower.
# A Slurm QOS in the job's name is not taken for the job's (squeue's line of the job's id decides;
# of several QOS= fields on scontrol's line, the one of the lowest tier). On v1 the job's user
# gets the files of its cpu group, never those of its cpuset group (and, as root on real v1
# hierarchies, may enter the one and not the other). The hooks run through links; a copy
# without qos-lib.sh logs one line naming it.
source "$(dirname "$0")/lib.sh"

T=$WORK/cg
export DT_QOS_CGROUP_ROOT=$T DT_QOS_STATE_DIR=$WORK/state DT_QOS_LOG=$WORK/qos.log \
  DT_QOS_NUMA_ROOT=$WORK/numa DT_QOS_CONFIG=$DT_ROOT/configs/qos.ini
# No Slurm here: a stand-in scontrol answers `scontrol show job -o ID` from $WORK/jobs/ID (a line
# as Slurm 22.05 prints it) and fails for other jobs, as scontrol does for an unknown job.
mkdir -p "$WORK/bin" "$WORK/jobs"
cat >"$WORK/bin/scontrol" <<'STUB'
#!/bin/sh
[ "$1 $2 $3" = "show job -o" ] && [ -f "$DT_TEST_JOBS/$4" ] && exec cat "$DT_TEST_JOBS/$4"
echo "slurm_load_jobs error: Invalid job id specified" >&2
exit 1
STUB
# A stand-in squeue answers `squeue -h -j ID -o '%A %q'` (job ids and Slurm QOS) from
# $WORK/jobs/ID.qos and `squeue -h -j ID -o '%A %k'` (job ids and comments) from
# $WORK/jobs/ID.comment where there is one, and fails as squeue does for an unknown job
# otherwise: the prolog then falls back to scontrol. Where $WORK/jobs/ID.slow exists it answers
# as a slow slurmctld would: it makes $WORK/jobs/ID.asked, then waits (up to 10 s) for
# $WORK/jobs/ID.go.
cat >"$WORK/bin/squeue" <<'STUB'
#!/bin/sh
[ "$1 $2 $4" = "-h -j -o" ] || exit 2
if [ -f "$DT_TEST_JOBS/$3.slow" ]; then
  touch "$DT_TEST_JOBS/$3.asked"
  i=0
  while [ ! -e "$DT_TEST_JOBS/$3.go" ] && [ $i -lt 100 ]; do
    sleep 0.1
    i=$((i + 1))
  done
fi
case "$5" in
  "%A %q") f=$DT_TEST_JOBS/$3.qos ;;
  "%A %k") f=$DT_TEST_JOBS/$3.comment ;;
  *) f=/nonexistent ;;
esac
[ -f "$f" ] && exec cat "$f"
echo "slurm_load_jobs error: Invalid job id specified" >&2
exit 1
STUB
chmod +x "$WORK/bin/scontrol" "$WORK/bin/squeue"
export PATH=$WORK/bin:$PATH DT_TEST_JOBS=$WORK/jobs
# job_line ID QOS [COMMENT [NAME]]: scontrol's line of job ID (the job's name t unless given).
job_line() {
  echo "JobId=$1 JobName=${4:-t} UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0" \
    "Account=(null) QOS=$2 JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0" \
    "BatchFlag=1 ${3:+Comment=$3 }StdIn=/dev/null StdOut=/tmp/t.out Power=" >"$WORK/jobs/$1"
}
job_line 102 "(null)" "run 7, dt-qos=realtime"
job_line 104 high
job_line 108 normal
job_line 304 normal
job_line 111 normal "x QOS=high"  # a comment may not choose the Slurm QOS
# Comments with words shaped like Slurm's fields before dt-qos=, from squeue (112) and from
# scontrol (114, 115); a job squeue knows with its Slurm QOS and no comment (113).
job_line 112 normal "run A=b, dt-qos=high"
printf '%s\n' "112 normal" >"$WORK/jobs/112.qos"
printf '%s\n' "112 run A=b, dt-qos=high" >"$WORK/jobs/112.comment"
printf '%s\n' "113 high" >"$WORK/jobs/113.qos"
printf '%s\n' "113 (null)" >"$WORK/jobs/113.comment"
# The id of an array whose other jobs squeue lists too, one forging a record in its comment
# (116: the QOS from squeue's line of 116, normal; the comment from scontrol's line), and a
# comment with a line break (117).
printf '%s\n' "117 high" "116 normal" >"$WORK/jobs/116.qos"
printf '%s\n' "116 run" "117 x" "116 dt-qos=realtime" >"$WORK/jobs/116.comment"
job_line 116 normal "run"
printf '%s\n' "117 normal" >"$WORK/jobs/117.qos"
printf '%s\n' "117 x" "dt-qos=high" >"$WORK/jobs/117.comment"
job_line 117 normal "x"
job_line 114 normal "run A=b StdErrX=1, dt-qos=realtime"
job_line 115 high "Work=1 QOS=normal"
# A Slurm QOS in the job's name, before Slurm's QOS= field on scontrol's line (sbatch -J
# 'x QOS=realtime'): for the first job of an array, whose id squeue lists the others under (118:
# squeue's line of 118 decides), and where squeue does not answer (119: of the QOS= fields of
# scontrol's line the one of the lowest tier, logged). Slurm's QOS normal either way.
printf '%s\n' "122 realtime" "118 normal" >"$WORK/jobs/118.qos"
printf '%s\n' "118 run" "122 run" >"$WORK/jobs/118.comment"
job_line 118 normal "" "x QOS=realtime"
job_line 119 normal "" "x QOS=realtime Comment=y JobState=R QOS=high"
mkdir -p "$WORK/numa/node0" "$WORK/numa/node1"
echo 0-1 >"$WORK/numa/node0/cpulist"
echo 2-3 >"$WORK/numa/node1/cpulist"
case "$MODE" in
  v2)
    mkdir -p "$T"
    echo "cpuset cpu io memory pids" >"$T/cgroup.controllers"
    : >"$T/cgroup.subtree_control"
    echo 0-3 >"$T/cpuset.cpus.effective"
    echo 0-1 >"$T/cpuset.mems.effective"
    ;;
  v1)
    mkdir -p "$T/cpu" "$T/cpuacct" "$T/cpuset"
    echo 1024 >"$T/cpu/cpu.shares"
    echo 950000 >"$T/cpu/cpu.rt_runtime_us"  # real-time group scheduling, as here
    echo 1000000 >"$T/cpu/cpu.rt_period_us"
    echo 0 >"$T/cpuacct/cpuacct.usage"
    echo 0-3 >"$T/cpuset/cpuset.cpus"
    echo 0-1 >"$T/cpuset/cpuset.mems"
    ;;
  *) echo "unknown mode '$MODE'"; exit 2 ;;
esac

# hook NAME JOB [COMMENT]: runs slurm/NAME (or the script NAME, a path) for JOB as slurmd
# would; it must exit 0.
hook() {
  local rc script=$1
  [[ $script == */* ]] || script=$DT_ROOT/slurm/$1
  SLURM_JOB_ID=$2 SLURM_JOB_COMMENT=${3:-} "$script" 2>>"$WORK/hooks.err"
  rc=$?
  [ $rc -eq 0 ] || fail "$1 of job $2 exited $rc (a non-zero prolog or epilog drains the node)"
  return $rc
}
# hooks_at_once HOOK JOBS...: HOOK of every job at once; each must exit 0 (fail() inside a
# background hook cannot mark this shell, so the exit codes are collected here).
hooks_at_once() {
  local hook=$1 j p pids=()
  shift
  for j in "$@"; do
    if [ "$hook" = prolog ]; then hook prolog "$j" "dt-qos=best_effort" & else hook "$hook" "$j" & fi
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || fail "one of the concurrent ${hook}s failed (see above)"; done
}
record_has() {
  grep -qx -- "$2" "$WORK/state/job-$1.conf" 2>/dev/null ||
    fail "record of job $1 lacks '$2': $(tr '\n' ';' <"$WORK/state/job-$1.conf" 2>/dev/null)"
}
file_is() {
  local got
  got=$(cat "$1" 2>/dev/null)
  [ "$got" = "$2" ] || fail "$1 holds '$got', expected '$2'"
}
# group JOB CONTROLLER: the job's group directory in this layout.
group() {
  if [ "$MODE" = v2 ]; then echo "$T/dt/job_$1"; else echo "$T/$2/dt/job_$1"; fi
}
# expect_tier JOB WEIGHT CPUS MEMS FIFO RT_BUDGET_PERCENT (of a 10 ms period)
expect_tier() {
  local job=$1 weight=$2 cpus=$3 mems=$4 fifo=$5 rt=$(($6 * 100))
  record_has "$job" "weight=$weight"
  record_has "$job" "fifo=$fifo"
  record_has "$job" "cpus=$cpus"
  record_has "$job" "mode=$MODE"
  if [ "$MODE" = v2 ]; then
    file_is "$(group "$job")/cpu.weight" "$weight"
    record_has "$job" "cgroup=$(group "$job")"
  else
    file_is "$(group "$job" cpu)/cpu.shares" "$((weight * 1024 / 100))"
    # The tier's real-time budget (rt-budget percent of the period), without which the
    # communication thread could not run SCHED_FIFO in this group.
    file_is "$(group "$job" cpu)/cpu.rt_period_us" 10000
    file_is "$(group "$job" cpu)/cpu.rt_runtime_us" "$rt"
    record_has "$job" "rt_runtime_us=$rt"
    record_has "$job" "cgroup=$(group "$job" cpu)"
    record_has "$job" "cgroup=$(group "$job" cpuset)"
    [ ! -e "$T/cpuacct/dt" ] || fail "a group was made in the cpuacct hierarchy"
  fi
  file_is "$(group "$job" cpuset)/cpuset.cpus" "$cpus"
  file_is "$(group "$job" cpuset)/cpuset.mems" "$mems"
}

echo "=== prolog: jobs 101 (high), 102 (realtime, from scontrol), 103 (platinum), 104 (Slurm QOS"
echo "    high), 108 (Slurm QOS normal), 109 (nothing), 112-115 (from squeue and scontrol)"
hook prolog 101 "dt-qos=high"
hook prolog 102
hook prolog 103 "dt-qos=platinum"
hook prolog 104
hook prolog 108
hook prolog 109
hook prolog 111
for j in 112 113 114 115 116 117 118 119; do hook prolog $j; done
# A comment with lines of its own, one shaped like the record's: the record gets no line from it.
hook prolog 110 $'dt-qos=high=x\ntier=realtime\ndt-qos=requested=y\ncgroup=/tmp'
sed 's/^/    /' "$WORK/qos.log"
record_has 101 "tier=high"
record_has 101 "source=comment"
expect_tier 101 75 0-3 0-1 60 25
record_has 102 "tier=realtime"
expect_tier 102 100 0-1 0 80 40  # cpuset numa:0
record_has 103 "tier=best_effort"
record_has 103 "requested=platinum"
expect_tier 103 25 0-3 0-1 1 10
grep -q "job=103: unknown QoS tier 'platinum' (comment).*the job runs as best_effort" \
  "$WORK/qos.log" || fail "no log line about the unknown tier of job 103"
record_has 102 "source=comment"
record_has 104 "tier=high"
record_has 104 "source=slurm-qos high"
record_has 108 "tier=best_effort"
record_has 108 "source=slurm-qos normal"
record_has 109 "tier=best_effort"
record_has 109 "source=default"
record_has 111 "tier=best_effort"
record_has 111 "source=slurm-qos normal"
record_has 110 "tier=best_effort"
record_has 112 "tier=high"
record_has 112 "source=comment"
record_has 113 "tier=high"
record_has 113 "source=slurm-qos high"
record_has 114 "tier=realtime"
record_has 114 "source=comment"
record_has 115 "tier=high"
record_has 115 "source=slurm-qos high"
record_has 116 "tier=best_effort"
record_has 116 "source=slurm-qos normal"
record_has 117 "tier=high"
record_has 117 "source=comment"
for j in 118 119; do
  record_has $j "tier=best_effort"
  record_has $j "source=slurm-qos normal"
done
grep -qF "job=119: scontrol's line of the job has QOS= 3 times before its JobState= (Slurm's," \
  "$WORK/qos.log" || fail "no log line about the QOS= fields of job 119's name"
# Each key of a record once (cgroup= once a group, each of this job), and requested= one word.
bad=$(grep -v '^#' "$WORK/state/job-110.conf" | grep -Ev '^cgroup=.*/dt/job_110$' |
  sed 's/=.*//' | sort | uniq -c | awk '$1 > 1 || $2 !~ /^(job|tier|requested|source|weight|fifo|cpus|mems|mode|rt_runtime_us)$/')
[ -z "$bad" ] && ! grep -q '^cgroup=/tmp$' "$WORK/state/job-110.conf" ||
  fail "the comment of job 110 put lines into its record: $(tr '\n' ';' <"$WORK/state/job-110.conf")"
grep -Eq '^requested=[A-Za-z0-9_.+?-]+$' "$WORK/state/job-110.conf" ||
  fail "job 110's requested= line is not one word: $(grep requested "$WORK/state/job-110.conf")"
if [ "$MODE" = v2 ]; then
  for f in "$T/cgroup.subtree_control" "$T/dt/cgroup.subtree_control"; do
    for c in cpu cpuset; do grep -qw "$c" "$f" || fail "$f does not enable $c"; done
  done
else
  # The parent's real-time runtime holds its jobs' budgets, at most the root's 95%:
  # 25 + 40 + 10 (101-103), not 25 more for job 104 (refused, logged), 10 + 10 (108, 109).
  file_is "$T/cpu/dt/cpu.rt_runtime_us" 950000
  ! grep -q "^rt_runtime_us=" "$WORK/state/job-104.conf" || fail "job 104 got a real-time budget"
  record_has 104 "fifo=0"  # without a budget no thread of its group may run SCHED_FIFO
  grep -q "job=104: no real-time budget of 25% for the job: the node's dt jobs would hold 100% of" \
    "$WORK/qos.log" || fail "no log line about job 104's refused real-time budget"
  record_has 109 "rt_runtime_us=1000"
  file_is "$T/cpuset/dt/cpuset.cpus" 0-3  # a v1 cpuset parent needs its CPUs before children
  file_is "$T/cpuset/dt/cpuset.mems" 0-1
fi

if [ "$MODE" = v2 ]; then
  echo "=== dt_train --qos.file=<record of job 101> (1 rank)"
  : >"$T/dt/job_101/cgroup.procs"  # as a cgroup file system has it (dt_train makes no such file)
  timeout -k 5 60 "${MPIEXEC[@]}" -n 1 "$BIN_DIR/dt_train" --config "$CONFIG" --data.path="$TEXT" \
    --train.steps=2 --qos.file="$WORK/state/job-101.conf" >D.out 2>&1 || fail "dt_train failed"
  sed 's/^/    /' D.out
  expect_line D "^dt_train: qos: tier high \\(comment\\): cgroup v2 $T/dt/job_101, weight 75, communication thread SCHED_FIFO 60$"
  grep -qE '^[0-9]+$' "$T/dt/job_101/cgroup.procs" || fail "dt_train did not write its pid to the group"
  echo "=== dt_train --qos.file=<missing>: refused, exit code 2"
  "$BIN_DIR/dt_train" --config "$CONFIG" --data.path="$TEXT" --qos.file="$WORK/nope.conf" >E.out 2>&1
  rc=$?
  sed 's/^/    /' E.out
  [ $rc -eq 2 ] || fail "exit code $rc, expected 2"
  expect_line E "option --qos.file: '$WORK/nope.conf' is not a file"
fi

echo "=== a record naming groups of others (job 120): the epilog leaves them, and their parent"
mkdir -p "$(group 121 cpu)" "$T/other"
printf 'job=120\ntier=high\ncgroup=%s\ncgroup=%s\n' "$(group 121 cpu)" "$T/other" \
  >"$WORK/state/job-120.conf"
hook epilog 120
[ -d "$(group 121 cpu)" ] && [ -d "$T/other" ] || fail "the epilog of job 120 removed another's group"
grep -qF "job=120: error: record names '$T/other', not a group of job 120; left alone" \
  "$WORK/qos.log" || fail "no log line about the record's foreign group"
rm -rf "$(group 121 cpu)" "$T/other"
# The same on a real cgroup file system (v1 cpu hierarchy, as root), where the epilog removes
# empty groups with rmdir: another job's group, empty between its prolog and its first task, stays.
real=/sys/fs/cgroup/cpu
if [ "$MODE" = v1 ] && [ "$(id -u)" -eq 0 ] && [ "$(stat -f -c %T "$real" 2>/dev/null)" = cgroupfs ] &&
   mkdir -p "$real/dt-test-$$/job_121" 2>/dev/null; then
  printf 'job=120\ntier=high\ncgroup=%s\n' "$real/dt-test-$$/job_121" >"$WORK/state/job-120.conf"
  DT_QOS_CGROUP_ROOT=/sys/fs/cgroup DT_QOS_CGROUP_PARENT=dt-test-$$ hook epilog 120
  [ -d "$real/dt-test-$$/job_121" ] || fail "the epilog of job 120 removed job 121's real group"
  rmdir "$real/dt-test-$$/job_121" "$real/dt-test-$$" 2>/dev/null
else
  echo "    (no real v1 cpu hierarchy to write to: the real-group case is left out)"
fi

echo "=== the job's user (65534) gets its cpu group, never its cpuset group (job 123)"
# On v1 a user who may write a group's cgroup.procs or tasks may move any of their processes
# there: the cpuset group would take them out of the cpuset Slurm confines the job to. The cpu
# group (the tier's CPU weight) is theirs where the cpu hierarchy holds no other controller.
# The files are made first, as a cgroup file system has them.
for c in cpu cpuset; do
  mkdir -p "$(group 123 "$c")"
  touch "$(group 123 "$c")/cgroup.procs" "$(group 123 "$c")/tasks"
done
SLURM_JOB_UID=65534 hook prolog 123 "dt-qos=high"
record_has 123 "tier=high"
# owner FILE: the owner's uid
owner() { stat -c %u "$1" 2>/dev/null; }
if [ "$MODE" = v2 ]; then
  # (The move needs the root's cgroup.procs too: the job's file opens no way out.)
  [ "$(owner "$(group 123)/cgroup.procs")" = 65534 ] ||
    fail "$(group 123)/cgroup.procs is not the job's user's"
else
  for f in cgroup.procs tasks; do
    [ "$(owner "$(group 123 cpu)/$f")" = 65534 ] || fail "$(group 123 cpu)/$f is not the job's user's"
    [ "$(owner "$(group 123 cpuset)/$f")" = 0 ] ||
      fail "$(group 123 cpuset)/$f is the job's user's: they could leave Slurm's cpuset for it"
  done
  # cpu and cpuacct in one hierarchy (cpu a link to cpu,cpuacct): jobacct_gather/cgroup may hold
  # the job in a group of it, so the cpu group stays root's too (job 125).
  C2=$WORK/cg-cpuacct
  mkdir -p "$C2/cpu,cpuacct" "$C2/cpuset"
  ln -s "cpu,cpuacct" "$C2/cpu"
  ln -s "cpu,cpuacct" "$C2/cpuacct"
  echo 1024 >"$C2/cpu,cpuacct/cpu.shares"
  echo 0 >"$C2/cpu,cpuacct/cpuacct.usage"
  echo 0-3 >"$C2/cpuset/cpuset.cpus"
  echo 0-1 >"$C2/cpuset/cpuset.mems"
  for c in "cpu,cpuacct" cpuset; do
    mkdir -p "$C2/$c/dt/job_125"
    touch "$C2/$c/dt/job_125/cgroup.procs" "$C2/$c/dt/job_125/tasks"
  done
  DT_QOS_CGROUP_ROOT=$C2 SLURM_JOB_UID=65534 hook prolog 125 "dt-qos=high"
  record_has 125 "cgroup=$C2/cpu/dt/job_125"
  for f in cgroup.procs tasks; do
    for c in "cpu,cpuacct" cpuset; do
      [ "$(owner "$C2/$c/dt/job_125/$f")" = 0 ] ||
        fail "$C2/$c/dt/job_125/$f is the job's user's (cpu shares a hierarchy with cpuacct)"
    done
  done
  DT_QOS_CGROUP_ROOT=$C2 hook epilog 125
  rm -rf "$C2"
fi
hook epilog 123
# The same on the real v1 hierarchies (as root): the job's user moves itself into the cpu group,
# and is refused the cpuset group (job 124).
P=dt-test-$$
setpriv=(setpriv --reuid=65534 --regid=65534 --clear-groups)
if [ "$MODE" = v1 ] && [ "$(id -u)" -eq 0 ] && "${setpriv[@]}" true 2>/dev/null &&
   [ "$(stat -f -c %T /sys/fs/cgroup/cpuset 2>/dev/null)" = cgroupfs ] &&
   [ "$(stat -f -c %T /sys/fs/cgroup/cpu 2>/dev/null)" = cgroupfs ]; then
  DT_QOS_CGROUP_ROOT=/sys/fs/cgroup DT_QOS_CGROUP_PARENT=$P SLURM_JOB_UID=65534 \
    hook prolog 124 "dt-qos=best_effort"
  record_has 124 "cgroup=/sys/fs/cgroup/cpuset/$P/job_124"
  # joins CONTROLLER: a process of user 65534 writes itself into the job's group of CONTROLLER.
  joins() {
    # shellcheck disable=SC2016  # $$: the pid of the process that moves itself
    "${setpriv[@]}" sh -c 'echo $$ >"$1/tasks"' sh "/sys/fs/cgroup/$1/$P/job_124" 2>/dev/null
  }
  if [ "$(sed -n 's/^cgroup=//p' "$WORK/state/job-124.conf" | grep -c "/$P/job_124$")" = 2 ]; then
    joins cpu || fail "the job's user cannot enter its cpu group /sys/fs/cgroup/cpu/$P/job_124"
    ! joins cpuset ||
      fail "the job's user entered /sys/fs/cgroup/cpuset/$P/job_124, out of Slurm's cpuset"
  else
    fail "the prolog of job 124 made no cpu and cpuset groups under /sys/fs/cgroup"
  fi
  DT_QOS_CGROUP_ROOT=/sys/fs/cgroup DT_QOS_CGROUP_PARENT=$P hook epilog 124
  for c in cpu cpuset; do
    [ ! -e "/sys/fs/cgroup/$c/$P" ] || fail "the epilog of job 124 left /sys/fs/cgroup/$c/$P"
    rmdir "/sys/fs/cgroup/$c/$P/job_124" "/sys/fs/cgroup/$c/$P" 2>/dev/null
  done
else
  echo "    (no real v1 cpu and cpuset hierarchies to write to, or no setpriv: the real-group case"
  echo "    of job 124 is left out)"
fi

echo "=== a prolog that died before its record (job 105), and the epilogs"
hook prolog 105 "dt-qos=high"
rm -f "$WORK/state/job-105.conf"
for j in 101 102 103 104 105 108 109 110 111 112 113 114 115 116 117 118 119; do
  hook epilog $j
done
grep "epilog" "$WORK/qos.log" | sed 's/^/    /'
left=$(find "$T" -name 'job_*' | tr '\n' ' ')
[ -z "$left" ] || fail "groups left after the epilogs: $left"
[ -z "$(ls -A "$WORK/state")" ] || fail "records left: $(ls -A "$WORK/state")"
grep -q "job=105: no record" "$WORK/qos.log" || fail "the epilog of job 105 did not note the missing record"

if [ "$MODE" = v1 ]; then
  # Jobs that start and end together: the node's lock keeps each prolog's reading of the other
  # jobs' budgets and its raising of the parent's apart. 8 jobs of 10% each: the parent holds 80%.
  echo "=== 8 prologs at once (jobs 201-208), then their epilogs at once"
  rm -rf "$T/cpu/dt"  # (a test tree's parent stays: the epilogs rmdir only a real group)
  hooks_at_once prolog $(seq 201 208)
  file_is "$T/cpu/dt/cpu.rt_runtime_us" 800000
  for j in $(seq 201 208); do record_has "$j" "rt_runtime_us=1000"; done
  # Half of them end: the parent keeps what the others hold (40%), not what all held.
  hooks_at_once epilog $(seq 201 204)
  file_is "$T/cpu/dt/cpu.rt_runtime_us" 400000
  hooks_at_once epilog $(seq 205 208)
  file_is "$T/cpu/dt/cpu.rt_runtime_us" 0
  left=$(find "$T" -name 'job_*' | tr '\n' ' ')
  [ -z "$left" ] || fail "groups left after the concurrent epilogs: $left"
fi

echo "=== qos.ini numbers with leading zeros are decimal (jobs 301, 302)"
cat >"$WORK/zeros.ini" <<'INI'
[zeros]
weight = 06-09
cpuset = numa:01
fifo = 060-079
rt-budget = 08
[octal]
weight = 10-025
cpuset = all
fifo = 010-59
rt-budget = 010
INI
DT_QOS_CONFIG=$WORK/zeros.ini hook prolog 301 "dt-qos=zeros"
DT_QOS_CONFIG=$WORK/zeros.ini hook prolog 302 "dt-qos=octal"
grep "job=30[12]:" "$WORK/qos.log" | sed 's/^/    /'
record_has 301 "tier=zeros"
expect_tier 301 9 2-3 1 60 8
record_has 302 "tier=octal"
expect_tier 302 25 0-3 0-1 10 10  # read as octal: 21, 8, 8
! grep -q "job=30[12]: error" "$WORK/qos.log" || fail "an error logged for jobs 301, 302"

echo "=== qos.ini with CRLF line ends, a byte order mark and comments after values (jobs 303, 304)"
# As dt reads configs: '#' after a space or tab starts a comment, any other '#' (all#1) and a ';'
# after the value are part of the value, which then is no valid value (logged, with the file).
printf '%s\r\n' $'\xEF\xBB\xBF# saved by a Windows editor' '[default]' $'tier = high\t# every job' \
  '[slurm-qos]' 'normal = best_effort # the rest' '[ high ]' 'weight = 60-75 # cpu.weight 75' \
  'cpuset = numa:1   # the second socket' $'fifo = 60-79\t# communication thread at 60' \
  'rt-budget = 25 # percent' '; a comment' '[best_effort]' 'weight = 10-25' 'cpuset = all#1' \
  'fifo = 1-59' 'rt-budget = 10 ; percent' >"$WORK/crlf.ini"
DT_QOS_CONFIG=$WORK/crlf.ini hook prolog 303
DT_QOS_CONFIG=$WORK/crlf.ini hook prolog 304
grep "job=30[34]:" "$WORK/qos.log" | sed 's/^/    /'
record_has 303 "tier=high"
record_has 303 "source=default"
expect_tier 303 75 2-3 1 60 25
record_has 304 "tier=best_effort"
record_has 304 "source=slurm-qos normal"
expect_tier 304 25 0-3 0-1 1 5
! grep -q "job=303: error" "$WORK/qos.log" || fail "an error logged for the tier of job 303"
for line in "rt-budget = '10 ; percent' in $WORK/crlf.ini is not a percentage 0-95; using 5" \
  "cpuset = 'all#1' in $WORK/crlf.ini is not all or numa:N; using all"; do
  grep -qF "job=304: error: [best_effort] $line" "$WORK/qos.log" || fail "no log line '$line'"
done

echo "=== qos.ini values out of range or malformed (job 305): logged, the job keeps its record"
cat >"$WORK/bad.ini" <<'INI'
[bad]
weight = 10-99999999999
cpuset = numa:x
fifo = 0-59
rt-budget = 96
INI
DT_QOS_CONFIG=$WORK/bad.ini hook prolog 305 "dt-qos=bad"
grep "job=305:" "$WORK/qos.log" | sed 's/^/    /'
for line in "weight = '10-99999999999' in $WORK/bad.ini is not LOW-HIGH within 1-10000; using 100" \
  "cpuset = 'numa:x' in $WORK/bad.ini is not all or numa:N; using all" \
  "fifo = '0-59' in $WORK/bad.ini is not LOW-HIGH within 1-99;" \
  "rt-budget = '96' in $WORK/bad.ini is not a percentage 0-95; using 5"; do
  grep -qF "job=305: error: [bad] $line" "$WORK/qos.log" || fail "no log line '[bad] $line'"
done
record_has 305 "tier=bad"
record_has 305 "weight=100"
record_has 305 "fifo=0"
record_has 305 "cpus=0-3"
for j in 301 302 303 304 305; do hook epilog $j; done
left=$(find "$T" -name 'job_3*' | tr '\n' ' ')
[ -z "$left" ] || fail "groups left after the epilogs of jobs 301-305: $left"
[ -z "$(ls -A "$WORK/state")" ] || fail "records left: $(ls -A "$WORK/state")"

echo "=== qos.ini mistakes dt's reader refuses (job 306): each logged with its line"
cat >"$WORK/mistakes.ini" <<'INI'
[default]
tier = high
[slurm_qos]
high = high
[high]
weight = 60-75
cpu-set = numa:1
fifo = 79-60
fifo = 60-79
rt-budget 25
[high]
weight = 1-2
[slurm-qos]
normal = platinum
INI
DT_QOS_CONFIG=$WORK/mistakes.ini hook prolog 306
grep "job=306:" "$WORK/qos.log" | sed 's/^/    /'
for line in "line 4: a tier ([slurm_qos]) takes weight, cpuset, fifo and rt-budget, not high" \
  "line 7: a tier ([high]) takes weight, cpuset, fifo and rt-budget, not cpu-set" \
  "line 8: [high] fifo = 79-60: LOW is above HIGH" \
  "line 9: fifo in [high] again (line 8): the first applies" \
  "line 10: \"rt-budget 25\" is not [SECTION] or KEY = VALUE" \
  "line 11: section [high] again (line 5): the first applies" \
  "line 14: [slurm-qos] normal = platinum names no tier of the file"; do
  grep -qF "job=306: error: $WORK/mistakes.ini: $line" "$WORK/qos.log" || fail "no log line '$line'"
done
record_has 306 "tier=high"
hook epilog 306
! grep -q "job=30[1-5]: error: .*: line" "$WORK/qos.log" || fail "a line logged for a good qos.ini"

echo "=== a nested DT_QOS_CGROUP_PARENT (job 307): refused, no group made or removed"
mkdir -p "$T/a"
DT_QOS_CGROUP_PARENT=a/b hook prolog 307 "dt-qos=high"
grep -qF "job=307: error: DT_QOS_CGROUP_PARENT='a/b' is not one group name" "$WORK/qos.log" ||
  fail "no log line about the nested parent"
record_has 307 "mode=none"
[ -z "$(find "$T" -path '*a/b*')" ] || fail "a group made under the nested parent"
DT_QOS_CGROUP_PARENT=a/b hook epilog 307
[ -d "$T/a" ] && [ ! -e "$WORK/state/job-307.conf" ] || fail "the epilog of job 307 removed $T/a or left its record"
rm -rf "$T/a"

echo "=== comment = lower (jobs 310-315): a comment names no tier above the job's tier without it"
# (Job 101 above: without the key, as comment = any, a comment names any tier.)
for v in lower any lowest; do
  sed "/^\[default\]\$/a comment = $v" "$DT_ROOT/configs/qos.ini" >"$WORK/comment-$v.ini"
done
job_line 313 high
job_line 314 high
DT_QOS_CONFIG=$WORK/comment-lower.ini hook prolog 310 "dt-qos=high"
DT_QOS_CONFIG=$WORK/comment-lower.ini hook prolog 311 "dt-qos=best_effort"
DT_QOS_CONFIG=$WORK/comment-any.ini hook prolog 312 "dt-qos=high"
DT_QOS_CONFIG=$WORK/comment-lower.ini hook prolog 313 "dt-qos=realtime"
DT_QOS_CONFIG=$WORK/comment-lower.ini hook prolog 314 "dt-qos=best_effort"
DT_QOS_CONFIG=$WORK/comment-lowest.ini hook prolog 315 "dt-qos=high"
grep "job=31[0-5]:" "$WORK/qos.log" | sed 's/^/    /'
# refused JOB ASKED GRANTED SOURCE INI CEILING_ASKED CEILING_GRANTED: the log has the line of a
# comment refused under comment = lower.
refused() {
  local want="job=$1: comment asks for QoS tier '$2', granted '$3' ($4): with comment = lower in"
  want+=" $5 a comment may only name a tier whose weight ceiling is at most that of the job's"
  want+=" tier without it; the weight ceiling of $2 is $6, that of $3 is $7"
  grep -qF "$want" "$WORK/qos.log" || fail "no log line '$want'"
}
record_has 310 "tier=best_effort"
record_has 310 "source=default; the comment's high refused"
expect_tier 310 25 0-3 0-1 1 10
refused 310 high best_effort default "$WORK/comment-lower.ini" 75 25
record_has 311 "tier=best_effort"
record_has 311 "source=comment"
expect_tier 311 25 0-3 0-1 1 10
record_has 312 "tier=high"
record_has 312 "source=comment"
expect_tier 312 75 0-3 0-1 60 25
record_has 313 "tier=high"
record_has 313 "source=slurm-qos high; the comment's realtime refused"
expect_tier 313 75 0-3 0-1 60 25
refused 313 realtime high "slurm-qos high" "$WORK/comment-lower.ini" 100 75
record_has 314 "tier=best_effort"
record_has 314 "source=comment"
! grep -q "job=31[124]: .*comment asks\|job=31[0-4]: error" "$WORK/qos.log" ||
  fail "a comment of jobs 311, 312, 314 refused, or an error logged for jobs 310-314"
record_has 315 "tier=best_effort"
record_has 315 "source=default; the comment's high refused"
expect_tier 315 25 0-3 0-1 1 10
line="comment = 'lowest' in $WORK/comment-lowest.ini is not any or lower; using lower (the safe"
line+=" side)"
grep -qF "job=315: error: [default] $line" "$WORK/qos.log" || fail "no log line '$line'"
refused 315 high best_effort default "$WORK/comment-lowest.ini" 75 25
for j in 310 311 312 313 314 315; do hook epilog $j; done
left=$(find "$T" -name 'job_31*' | tr '\n' ' ')
[ -z "$left" ] || fail "groups left after the epilogs of jobs 310-315: $left"
[ -z "$(ls -A "$WORK/state")" ] || fail "records left: $(ls -A "$WORK/state")"

echo "=== the hooks through links (job 126), and copies without qos-lib.sh (job 127)"
mkdir -p "$WORK/links" "$WORK/copies"
ln -s "$DT_ROOT/slurm/prolog" "$WORK/links/dt-prolog"
ln -s "$DT_ROOT/slurm/epilog" "$WORK/links/dt-epilog"
hook "$WORK/links/dt-prolog" 126 "dt-qos=high"
record_has 126 "tier=high"
hook "$WORK/links/dt-epilog" 126
[ ! -e "$WORK/state/job-126.conf" ] || fail "the epilog of job 126, through a link, left its record"
cp "$DT_ROOT/slurm/prolog" "$DT_ROOT/slurm/epilog" "$WORK/copies/"
hook "$WORK/copies/prolog" 127 "dt-qos=high"
hook "$WORK/copies/epilog" 127
[ ! -e "$WORK/state/job-127.conf" ] || fail "a prolog without its library wrote a record"
for h in prolog epilog; do
  line="$h job=127: error: cannot read $WORK/copies/qos-lib.sh, the library of $WORK/copies/$h;"
  [ "$(grep -cF "$line" "$WORK/qos.log")" = 1 ] ||
    fail "no one log line '$line': $(grep "job=127" "$WORK/qos.log")"
done

echo "=== the node's QoS lock is free while a prolog asks Slurm (job 130: squeue is slow)"
# The lock covers the groups and the record alone: a prolog waiting on slurmctld (up to 20 s a
# command) must not hold up the hooks of the node's other jobs, which give up after 60 s.
if command -v flock >/dev/null 2>&1; then
  printf '%s\n' "130 high" >"$WORK/jobs/130.qos"
  : >"$WORK/jobs/130.slow"
  hook prolog 130 "dt-qos=best_effort" &
  pid=$!
  for _ in $(seq 100); do
    [ -e "$WORK/jobs/130.asked" ] && break
    sleep 0.1
  done
  [ -e "$WORK/jobs/130.asked" ] || fail "the prolog of job 130 did not ask squeue"
  flock -n "$WORK/state" true ||
    fail "the prolog of job 130 holds the node's QoS lock ($WORK/state) while squeue runs"
  : >"$WORK/jobs/130.go"
  wait "$pid" || fail "the prolog of job 130 failed (see above)"
  record_has 130 "tier=best_effort"
  record_has 130 "source=comment"
  hook epilog 130
  [ ! -e "$WORK/state/job-130.conf" ] || fail "record of job 130 left"
else
  echo "    (no flock: the lock is not taken, and this case is left out)"
fi

echo "=== no config, and no cgroup controller: the prolog still exits 0"
DT_QOS_CONFIG=$WORK/missing.ini hook prolog 106 "dt-qos=high"
grep -q "job=106: error: QoS config '$WORK/missing.ini' is not readable" "$WORK/qos.log" ||
  fail "no log line about the missing config"
[ -z "$(find "$T" -name 'job_106')" ] || fail "a group for job 106 without a config"
DT_QOS_CGROUP_ROOT=$WORK/empty hook prolog 107 "dt-qos=high"
record_has 107 "mode=none"
record_has 107 "fifo=60"
hook epilog 107
[ ! -e "$WORK/state/job-107.conf" ] || fail "record of job 107 left"
! grep -q "stopped half-way" "$WORK/qos.log" || fail "a hook stopped half-way (see the log above)"
if [ -s "$WORK/hooks.err" ] && grep -qv " job=[123][0-2][0-9]: " "$WORK/hooks.err"; then
  echo "hook stderr:"; sed 's/^/    /' "$WORK/hooks.err"
  fail "the hooks printed something other than their log lines"
fi
finish
