#!/usr/bin/env bash
# train.node_memory: a run whose ranks cannot fit the memory left to them is refused before it
# allocates (exit 2), naming the node, what the ranks need and what is left, and where that limit
# comes from: here a memory cgroup of 128 MiB (v2 memory.max or v1 memory.limit_in_bytes) made
# for the test, in which a model of about 200 MiB is refused and the micro config trains.
# train.node_memory_pipeline (a launcher given): two pipeline stages of a model of 25M
# parameters (about 97 MiB in fp32) in a group of 560 MiB, within the plan's figures for them:
# they train, holding what the plan counts (each rank used to hold a copy of the whole model
# besides, which the plan does not count, and was killed there).
# Skipped (77) without root or a memory cgroup controller to make a group in.
#   node_memory.sh DT_TRAIN CONFIG TEXT [MPIEXEC...]
set -u
BIN=$1 CONFIG=$2 TEXT=$3
shift 3
LAUNCH=("$@")
[ "$(id -u)" -eq 0 ] || { echo "node_memory.sh: needs root; skipped"; exit 77; }
mnt="" grp="" limit_file=""
if v2=$(findmnt -rn -t cgroup2 -o TARGET | head -n1) && [ -n "$v2" ] &&
   grep -qw memory "$v2/cgroup.controllers" 2>/dev/null; then
  mnt=$v2 grp=$(sed -n 's/^0::\(.*\)$/\1/p' /proc/self/cgroup) limit_file=memory.max
  grep -qw memory "$mnt$grp/cgroup.subtree_control" 2>/dev/null || mnt=""
fi
if [ -z "$mnt" ]; then
  mnt=$(findmnt -rn -t cgroup -O memory -o TARGET | head -n1)
  grp=$(sed -n 's/^[0-9]*:\([^:]*,\)\{0,1\}memory\(,[^:]*\)\{0,1\}:\(.*\)$/\3/p' /proc/self/cgroup | head -n1)
  limit_file=memory.limit_in_bytes
fi
dir=${mnt}${grp%/}/dt-node-memory-$$
if [ -z "$mnt" ] || ! mkdir "$dir" 2>/dev/null; then
  echo "node_memory.sh: no memory cgroup to make a group in ($dir); skipped"
  exit 77
fi
trap 'rmdir "$dir" 2>/dev/null' EXIT
limit=$((128 << 20))
[ ${#LAUNCH[@]} -eq 0 ] || limit=$((560 << 20))
echo "$limit" >"$dir/$limit_file" || { echo "node_memory.sh: FAIL: cannot set $dir/$limit_file"; exit 1; }
echo "group $dir, $limit_file = $(cat "$dir/$limit_file")"
run() {
  sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$dir" ${LAUNCH[@]+"${LAUNCH[@]}"} "$BIN" \
    --config "$CONFIG" --data.path="$TEXT" --train.steps=2 "$@" 2>&1
}
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
if [ ${#LAUNCH[@]} -gt 0 ]; then
  out=$(run --model.embd=512 --model.layers=8 --model.heads=8 --parallel.pp=2 --train.batch=4 \
    --train.micro-batch=2)
  rc=$?
  echo "$out" | sed 's/^/  pipeline: /'
  [ "$rc" -eq 0 ] || fail "two pipeline stages within the plan's memory: exit code $rc, expected 0"
  echo "$out" | grep -q "^dt_train: peak resident memory per rank:" ||
    fail "no line of the peak resident memory"
  [ $FAILED -eq 0 ] && { echo "node_memory.sh: PASS"; exit 0; }
  echo "node_memory.sh: FAIL"
  exit 1
fi
out=$(run --model.embd=256 --model.layers=16 --model.heads=4)
rc=$?
echo "$out" | sed 's/^/  big: /'
[ "$rc" -eq 2 ] || fail "the model of about 200 MiB: exit code $rc, expected 2"
echo "$out" | grep -Eq "the 1 rank\(s\) on node $(hostname) need at least [0-9.]+ MiB \([0-9.]+ MiB each: .*\), but the node has [0-9.]+ (KiB|MiB) left \($dir/$limit_file\)" ||
  fail "no line names the node, both figures and $dir/$limit_file"
echo "$out" | grep -Eq "^dt_train: [0-9]+ parameters," && fail "the refused run allocated its model first"
out=$(run)
rc=$?
echo "$out" | sed 's/^/  micro: /'
[ "$rc" -eq 0 ] || fail "the micro config in the same group: exit code $rc, expected 0"
[ $FAILED -eq 0 ] && { echo "node_memory.sh: PASS"; exit 0; }
echo "node_memory.sh: FAIL"
exit 1
