#!/usr/bin/env bash
# train.node_memory: a run whose ranks cannot fit the memory left to them is refused before it
# allocates (exit 2), naming the node, what the ranks need and what is left, and where that limit
# comes from: here a memory cgroup of 128 MiB (v2 memory.max or v1 memory.limit_in_bytes) made
# for the test, in which a model of about 200 MiB is refused and the micro config trains.
# Skipped (77) without root or a memory cgroup controller to make a group in.
#   node_memory.sh DT_TRAIN CONFIG TEXT
set -u
BIN=$1 CONFIG=$2 TEXT=$3
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
echo $((128 << 20)) >"$dir/$limit_file" || { echo "node_memory.sh: FAIL: cannot set $dir/$limit_file"; exit 1; }
echo "group $dir, $limit_file = $(cat "$dir/$limit_file")"
run() {
  sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$dir" "$BIN" --config "$CONFIG" \
    --data.path="$TEXT" --train.steps=2 "$@" 2>&1
}
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
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
