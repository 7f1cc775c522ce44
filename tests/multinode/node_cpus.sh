#!/usr/bin/env bash
# node_cpus.sh DT_TOPO
# multinode.node_cpus: namespaced nodes run on CPUs of their own, as separate machines do. On 2
# nodes x 2 ranks, dt_topo's table must show every rank in its launcher's binding: the node's CPUs,
# kept where they are one core and split between the node's two ranks where they are more, and
# the two nodes on disjoint CPUs that together are every CPU
# this test may use, on different physical cores where there are 2 or more (hyperthreads of one
# core are not separate machines). Skipped with one CPU.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$("$here/mpirun-nodes.sh" 2 2 "$1" --check.bandwidth-iters=1 --check.latency-iters=10 2>&1)
rc=$?
echo "$out"
[ "$rc" -eq 77 ] && exit 77
[ "$rc" -eq 0 ] || { echo "FAIL: dt_topo exited $rc"; exit 1; }
allowed=$(python3 -c 'import os; print(",".join(map(str, sorted(os.sched_getaffinity(0)))))')
if [ "$(tr ',' '\n' <<<"$allowed" | wc -l)" -lt 2 ]; then
  echo "node_cpus: one CPU allowed, nothing to share out; skipped"
  exit 77
fi
TOPO=$out PYTHONPATH=$here python3 - "$allowed" <<'PY'
import os, re, sys
from cpus import core
allowed = set(int(c) for c in sys.argv[1].split(","))
def cpus(text):  # "0-1,3" -> {0, 1, 3}
    s = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        s.update(range(int(a), int(b or a) + 1))
    return s
def cores(cpus):  # the physical cores (package, core) of a set of CPUs
    return {core(c) for c in cpus}
nodes = {}
for line in os.environ["TOPO"].splitlines():
    m = re.match(r"^(\d+)\s+(dtn\d+)\s+\S+\s.*?((?:\d+:[0-9,-]+(?:\(\w+\))?\s*)+)$", line.rstrip())
    if not m:
        continue
    for rank, cs, mode in re.findall(r"(\d+):([0-9,-]+)(?:\((\w+)\))?", m.group(3)):
        mode = mode or "cores"  # dt_topo marks every mode but its own binding
        if mode not in ("launcher", "split"):
            sys.exit(f"FAIL: rank {rank} on {m.group(2)}: binding '{mode}', expected the launcher's")
        nodes.setdefault(m.group(2), []).append((mode, cpus(cs)))
if sorted(nodes) != ["dtn1", "dtn2"] or any(len(v) != 2 for v in nodes.values()):
    sys.exit(f"FAIL: expected 2 ranks on each of dtn1 and dtn2, got {nodes}")
sets = {}
for host, v in nodes.items():
    (m0, c0), (m1, c1) = v
    if m0 != m1:
        sys.exit(f"FAIL: the ranks of {host} have bindings '{m0}' and '{m1}'")
    if m0 == "launcher" and (c0 != c1 or len(cores(c0)) > 1):
        sys.exit(f"FAIL: the ranks of {host} kept CPUs {sorted(c0)} and {sorted(c1)}: one core "
                 "they share, or a binding of more cores split between them, was expected")
    if m0 == "split" and c0 & c1:
        sys.exit(f"FAIL: the ranks of {host} split their CPUs into {sorted(c0)} and {sorted(c1)}")
    sets[host] = c0 | c1
a, b = sets["dtn1"], sets["dtn2"]
if a & b:
    sys.exit(f"FAIL: dtn1 (CPUs {sorted(a)}) and dtn2 (CPUs {sorted(b)}) share CPUs")
if a | b != allowed:
    sys.exit(f"FAIL: dtn1 {sorted(a)} and dtn2 {sorted(b)} are not the allowed CPUs {sorted(allowed)}")
if len(cores(allowed)) >= 2 and cores(a) & cores(b):
    sys.exit(f"FAIL: dtn1 (CPUs {sorted(a)}) and dtn2 (CPUs {sorted(b)}) share physical cores")
print(f"node_cpus: dtn1 on CPUs {sorted(a)}, dtn2 on CPUs {sorted(b)} of {sorted(allowed)}: ok")
PY
