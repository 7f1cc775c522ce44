#!/usr/bin/env bash
# slurm.spank: slurmstepd's plugin spank_dt_qos.so (the cluster's plugstack.conf, written by
# scripts/slurm-local up) puts every task of a job into the job's QoS groups before it runs, for
# a job of an ordinary user (uid 65534) too:
#   1. a job of plain programs (no dt_train): the batch script and each task of an srun step are
#      in each group the prolog's record names (/proc/self/cgroup, read by the tasks themselves);
#   2. dt_train's ranks of such a job find themselves there: the tier line lists every group as
#      entered and no rank warns that a move was refused;
#   3. a plugstack.conf argument the plugin does not take is logged by slurmstepd naming it, the
#      plugin is left out (the batch script stays out of the job's groups), and the job still
#      runs: a site's mistake never stops a job.
# Without the plugin the batch script and the tasks stay in slurmd's groups, and part 1 fails.
source "$(dirname "$0")/lib.sh"
need_cluster

PLUGSTACK=$(dirname "$SLURM_CONF")/plugstack.conf
if ! grep -q '^optional .*/spank_dt_qos\.so ' "$PLUGSTACK" 2>/dev/null; then
  sed 's/^/    /' "$PLUGSTACK" 2>/dev/null
  fail "$PLUGSTACK loads no spank_dt_qos.so: the cluster was started without it (build it, then" \
    "scripts/slurm-local down and up)"
  finish
fi
PLUGIN=$(awk '$1 == "optional" && $2 ~ /spank_dt_qos\.so$/ { print $2 }' "$PLUGSTACK")
[ -f "$PLUGIN" ] || { fail "$PLUGSTACK names $PLUGIN, which does not exist"; finish; }
echo "=== plugin: $PLUGIN"

USER_ID=65534
chmod 1777 "$WORK"
STATE_DIR=$(hook_setting DT_QOS_STATE_DIR)
CGROOT=$(hook_setting DT_QOS_CGROUP_ROOT)

# in_group FILE GROUP: the /proc/PID/cgroup copy FILE shows the process in the group directory
# GROUP (v1: ROOT/CONTROLLER/PATH, on the line of that controller; v2: ROOT/PATH, on line 0::).
in_group() {
  local file=$1 g=$2 rest ctrl
  rest=${g#"$CGROOT"/}
  if [ "$CGMODE" = v2 ]; then
    grep -qx "0::/$rest" "$file"
  else
    ctrl=${rest%%/*}
    grep -Eq "^[0-9]+:([^:]*,)?$ctrl(,[^:]*)?:/${rest#*/}\$" "$file"
  fi
}

# 1. Plain programs of an ordinary user's job.
echo "=== P: sbatch --uid=$USER_ID -n 2 --comment=dt-qos=high (batch script and srun -n 2)"
JOB=$(sbatch --parsable --uid=$USER_ID --gid=$USER_ID -n 2 --comment=dt-qos=high -D "$WORK" \
  -o "$WORK/P.out" --wrap "cat '$STATE_DIR/job-'\$SLURM_JOB_ID.conf >record.txt
cat /proc/self/cgroup >batch.cgroup
srun -n 2 sh -c 'cat /proc/self/cgroup >task-\$SLURM_PROCID.cgroup'" 2>&1) ||
  { echo "$JOB"; fail "P: sbatch refused the job"; finish; }
JOBS+=("$JOB")
expect_end P "$JOB" COMPLETED
node_healthy
sed 's/^/    record: /' record.txt
CGMODE=$(sed -n 's/^mode=//p' record.txt)
mapfile -t GROUPS_ < <(sed -n 's/^cgroup=//p' record.txt)
if [ "$CGMODE" = none ]; then
  echo "slurm.spank: skipped: this machine has no cgroup cpu controller (v1 or v2) to test"
  exit 77
fi
[ ${#GROUPS_[@]} -ge 1 ] || fail "the record of job $JOB names no group (mode '$CGMODE')"
for f in batch.cgroup task-0.cgroup task-1.cgroup; do
  [ -s "$f" ] || { fail "the job wrote no $f"; continue; }
  for g in "${GROUPS_[@]}"; do
    in_group "$f" "$g" ||
      fail "${f%.cgroup} of job $JOB is not in $g: $(grep -v '^[0-9]*:\(name=\|pids\|blkio\|devices\|freezer\)' "$f" | tr '\n' ' ')"
  done
done

# 2. dt_train's ranks in an ordinary user's job.
submit T -n 2 --uid=$USER_ID --gid=$USER_ID --comment=dt-qos=high -D "$WORK" -- "$CONFIG" \
  --data.path="$TEXT" --train.steps=5 --train.log-every=5 --train.eval-every=0
[ -n "$JOB" ] || finish
expect_end T "$JOB" COMPLETED
expect_line T "qos: tier high \(comment\): cgroup $CGMODE .*/job_$JOB"
expect_no_line T "not entered|cannot move this rank"
# The tier line says what the communication thread got (an ordinary user without RLIMIT_RTPRIO
# gets no SCHED_FIFO), as the ranks' warnings do.
if grep -q "SCHED_FIFO priority 60 refused for the communication thread" T.out; then
  expect_line T "qos: tier high .*, communication thread normal priority \(SCHED_FIFO 60 refused: "
else
  expect_line T "qos: tier high .*, communication thread SCHED_FIFO 60$"
fi

# 3. A bad argument in plugstack.conf: logged, naming it, and the plugin left out; the job runs
#    all the same.
use_plugstack "optional $PLUGIN state_dir=relative/dt-qos"
JOB=$(sbatch --parsable -n 1 --comment=dt-qos=high -D "$WORK" -o "$WORK/B.out" \
  --wrap "cat '$STATE_DIR/job-'\$SLURM_JOB_ID.conf >bad-record.txt
cat /proc/self/cgroup >bad.cgroup" 2>&1) || { echo "$JOB"; fail "B: sbatch refused the job"; finish; }
JOBS+=("$JOB")
expect_end B "$JOB" COMPLETED
restore_plugstack
SLURMD_LOG=$(sed -n 's/^SlurmdLogFile=//p' "$SLURM_CONF")
grep -F "[$JOB.batch]" "$SLURMD_LOG" | grep dt_qos | sed 's/^/    /'
grep -F "[$JOB.batch]" "$SLURMD_LOG" |
  grep -q "dt_qos: plugstack.conf argument 'state_dir=relative/dt-qos' is not state_dir=/ABSOLUTE/PATH" ||
  fail "B: slurmd's log of job $JOB does not name the bad plugstack.conf argument"
mapfile -t BAD_GROUPS < <(sed -n 's/^cgroup=//p' bad-record.txt)
[ ${#BAD_GROUPS[@]} -ge 1 ] || fail "the record of job $JOB names no group"
for g in "${BAD_GROUPS[@]}"; do
  ! in_group bad.cgroup "$g" || fail "B: the left-out plugin placed the batch script in $g"
done
node_healthy
finish
