#!/usr/bin/env bash
# rsh agent for mpirun: "ssh" into namespace node HOST = run the command inside netns HOST with
# hostname HOST. mpirun calls it as: rsh-agent.sh [options] HOST COMMAND...
# With DT_NODES=N (mpirun-nodes.sh sets it), node dtnI runs on its own share of this machine's
# CPUs, the I-th of N equal slices of the CPUs this agent may use (CPU (I-1) mod count when there
# are fewer CPUs than nodes), as the ranks of separate machines would: without it, each node's
# launcher would place its first rank on the same first core.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
pin=()
idx=${host#dtn}
if [ -n "${DT_NODES:-}" ] && [ "$idx" != "$host" ]; then
  mapfile -t cpus < <(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)), sep="\n")')
  c=${#cpus[@]} n=$DT_NODES
  if [ "$c" -ge "$n" ]; then
    list=$(printf '%s\n' "${cpus[@]:$(((idx - 1) * c / n)):$((idx * c / n - (idx - 1) * c / n))}" | paste -sd,)
  else
    list=${cpus[$(((idx - 1) % c))]}
  fi
  pin=(taskset -c "$list")
fi
exec ip netns exec "$host" "${pin[@]}" unshare --uts bash -c "hostname $host; $*"
