#!/usr/bin/env bash
# slurm.bad_input: user mistakes never drain the node or leave cgroups behind, and each gets a
# clear message:
#   an unknown tier (--comment=dt-qos=platinum): the job runs as best_effort, the job's output and
#     the QoS log say so;
#   a missing config: the job fails with exit code 2 naming the file, and is not requeued;
#   a bad --signal time (not a number, negative, beyond Slurm's 65535 s) or signal: sbatch refuses it,
#     naming --signal, and nothing is queued;
#   scripts/slurm-local up from a checkout whose path has a blank, or with a DT_SLURM_DIR that has
#     one: refused at once, naming the path and why (slurm.conf and plugstack.conf take a path as
#     one word), before anything is made.
source "$(dirname "$0")/lib.sh"
need_cluster
QOS_LOG=$(hook_setting DT_QOS_LOG)

submit U -n 2 --comment=dt-qos=platinum -- "$CONFIG" --data.path="$TEXT" --train.steps=5
if [ -n "$JOB" ]; then
  expect_end U "$JOB" COMPLETED
  expect_line U "^dt_train: qos: tier best_effort \\(the job asked for tier 'platinum', which the QoS config does not define\\)"
  grep -q "job=$JOB: unknown QoS tier 'platinum' (comment).*the job runs as best_effort" "$QOS_LOG" ||
    fail "no line about tier 'platinum' of job $JOB in $QOS_LOG"
  node_healthy
  no_job_groups "$JOB"
fi

submit M -n 2 -- "$WORK/missing.ini" --data.path="$TEXT"
if [ -n "$JOB" ]; then
  expect_end M "$JOB" FAILED
  [ "$(job_field "$JOB" ExitCode)" = "2:0" ] || fail "M: exit code $(job_field "$JOB" ExitCode), expected 2:0"
  [ "$(job_field "$JOB" Restarts)" = 0 ] || fail "M: the job was requeued"
  expect_line M "^dt-train: error: config file '$WORK/missing.ini' \\(first argument\\) does not exist or is not readable$"
  node_healthy
  no_job_groups "$JOB"
fi

before=$(squeue -h | wc -l)
for spec in B:USR1@soon B:USR1@-30 B:USR1@99999 B:NOSUCHSIG@60; do
  echo "=== sbatch --signal=$spec"
  out=$(sbatch --parsable --signal="$spec" -n 2 -o "$WORK/S.out" "$SBATCH_SCRIPT" "$CONFIG" \
    --data.path="$TEXT" 2>&1)
  rc=$?
  echo "    $out (exit code $rc)"
  if [ $rc -eq 0 ]; then
    JOBS+=("${out%%;*}")
    fail "sbatch accepted --signal=$spec"
  fi
  grep -q -- "--signal" <<<"$out" || fail "sbatch's message for --signal=$spec does not name --signal"
done
[ "$(squeue -h | wc -l)" = "$before" ] || fail "jobs were queued: $(squeue -h)"

# local_up NAME SETTINGS... -- SCRIPT: `SCRIPT up` with only SETTINGS of dt's (NAME=VALUE) set;
# its output in $out, its exit code in $rc.
local_up() {
  local name=$1 settings=() line
  shift
  while [ "$1" != -- ]; do settings+=("$1"); shift; done
  echo "=== $name: ${settings[*]} $2 up"
  out=$(env -u DT_SLURM_DIR -u DT_SPANK_PLUGIN "${settings[@]}" "$2" up 2>&1)
  rc=$?
  while IFS= read -r line; do echo "    $line"; done <<<"$out"
  [ "$rc" -ne 0 ] || fail "$name: scripts/slurm-local up succeeded"
  grep -q "DT_SPANK_PLUGIN '" <<<"$out" && fail "$name: the message names DT_SPANK_PLUGIN as set"
  return 0
}
C="$WORK/a checkout"
mkdir -p "$C/scripts"
cp "$DT_ROOT/scripts/slurm-local" "$DT_ROOT/scripts/bootstrap" "$C/scripts/"
local_up checkout -- "$C/scripts/slurm-local"
want="error: the checkout '$C' has a blank in its path, and so has its Slurm folder"
want+=" '$C/run/slurm': slurm.conf takes the paths under it as single words"
[[ $out == *"$want"* ]] ||
  fail "checkout: the message does not name the checkout, its Slurm folder and why"
[ ! -e "$C/run" ] || fail "checkout: $C/run was made"
local_up dir DT_SLURM_DIR="$WORK/slurm folder" -- "$DT_ROOT/scripts/slurm-local"
[[ $out == *"error: DT_SLURM_DIR '$WORK/slurm folder' has a blank in its path: slurm.conf"* ]] ||
  fail "dir: the message does not name DT_SLURM_DIR and why"
[ ! -e "$WORK/slurm folder" ] || fail "dir: $WORK/slurm folder was made"
local_up plugin DT_SLURM_DIR="$WORK/slurm" -- "$C/scripts/slurm-local"
want="error: the checkout '$C' has a blank in its path: its SPANK plugin"
[[ $out == *"$want"*"cannot go into plugstack.conf"* ]] ||
  fail "plugin: the message does not name the checkout and the plugin"
[ ! -e "$WORK/slurm" ] || fail "plugin: $WORK/slurm was made"
node_healthy
finish
