#!/usr/bin/env bash
# rsh agent for mpirun: "ssh" into namespace node HOST = run the command inside netns HOST with
# hostname HOST. mpirun calls it as: rsh-agent.sh [options] HOST COMMAND...
# With DT_NODES=N (mpirun-nodes.sh sets it), node dtnI runs on its own share of this machine:
# the I-th of N equal slices of the physical cores this agent may use, with their CPUs (the
# hyperthreads of one core stay together), or of the CPUs when there are fewer cores than nodes
# (CPU (I-1) mod count when there are fewer CPUs too), as the ranks of separate machines would:
# without it, each node's launcher would place its first rank on the same first core.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
pin=()
idx=${host#dtn}
if [ -n "${DT_NODES:-}" ] && [ "$idx" != "$host" ]; then
  list=$(python3 - "$idx" "$DT_NODES" <<'PY'
import os, sys
i, n = int(sys.argv[1]), int(sys.argv[2])
cpus = sorted(os.sched_getaffinity(0))
def core(c):
    base = f"/sys/devices/system/cpu/cpu{c}/topology/"
    try:
        return (open(base + "physical_package_id").read().strip(),
                open(base + "core_id").read().strip())
    except OSError:
        return ("?", str(c))
groups = {}
for c in cpus:
    groups.setdefault(core(c), []).append(c)
units = sorted(groups.values()) if len(groups) >= n else [[c] for c in cpus]
if len(units) >= n:
    mine = [c for u in units[(i - 1) * len(units) // n:i * len(units) // n] for c in u]
else:
    mine = [cpus[(i - 1) % len(cpus)]]
print(",".join(map(str, sorted(mine))))
PY
)
  pin=(taskset -c "$list")
fi
exec ip netns exec "$host" "${pin[@]}" unshare --uts bash -c "hostname $host; $*"
