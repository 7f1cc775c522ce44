#!/usr/bin/env bash
# watchdog.sh TIMEOUT DUMPDIR SKIP_RANK -- CMD...
# CMD is a dt_train job in which rank SKIP_RANK never joins a collective (test.skip-collective)
# and the hang watchdog has TIMEOUT seconds. The job must end within TIMEOUT + 10 s of the skip,
# exit non-zero, print one watchdog line naming that rank and the collective, and leave a dump
# that names them too.
set -u
timeout_s=$1 dump=$2 skip=$3
shift 4
rm -rf "$dump"
mkdir -p "$dump"
log=$dump/job.log
"$@" --comm.timeout-s="$timeout_s" --comm.dump-dir="$dump" --test.skip-collective="$skip" \
  >"$log" 2>&1 &
pid=$!
t_skip=""
while kill -0 "$pid" 2>/dev/null; do
  if [ -z "$t_skip" ] && grep -q "rank $skip: test.skip-collective: skipping" "$log"; then
    t_skip=$(date +%s.%N)
  fi
  sleep 0.1
done
wait "$pid"
rc=$?
t_end=$(date +%s.%N)
cat "$log"
fail() { echo "watchdog.sh: FAIL: $*"; exit 1; }
[ -n "$t_skip" ] || fail "rank $skip never reported skipping the collective"
[ "$rc" -ne 0 ] || fail "the job exited 0"
took=$(awk -v a="$t_end" -v b="$t_skip" 'BEGIN { printf "%.1f", a - b }')
awk -v t="$took" -v l="$timeout_s" 'BEGIN { exit !(t <= l + 10) }' || fail "the job ended ${took} s after the skip (limit $timeout_s + 10 s)"
line=$(grep -m1 '^dt watchdog: ' "$log") || fail "no watchdog line"
echo "$line" | grep -qE "all_reduce #[0-9]+ on world .* rank $skip has not reached it" ||
  fail "the watchdog line does not name rank $skip and the all_reduce on world"
f=$(ls "$dump"/dt-watchdog-rank*.json 2>/dev/null | head -1)
[ -n "$f" ] || fail "no dump in $dump"
python3 - "$f" "$skip" <<'PY' || fail "dump $f does not name rank $skip and the collective"
import json, sys
d = json.load(open(sys.argv[1]))
skip = int(sys.argv[2])
assert d["missing_ranks"] == [skip], d["missing_ranks"]
c = d["collective"]
assert c["op"] == "all_reduce" and c["comm"] == "world" and c["seq"] > 0, c
ranks = {r["rank"]: r for r in d["ranks"]}
assert ranks[skip]["comms"]["world"]["started"] < c["seq"]
assert "skip-collective" in ranks[skip]["activity"]
for r in ranks.values():  # every rank sent its recent collectives
    assert r["records"] and all({"comm", "seq", "op", "bytes"} <= set(x) for x in r["records"])
PY
echo "watchdog.sh: PASS: exit $rc after ${took} s, rank $skip named"
