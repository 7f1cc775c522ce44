#!/usr/bin/env bash
# rsh agent for mpirun: "ssh" into namespace node HOST = run the command inside netns HOST with
# hostname HOST. mpirun calls it as: rsh-agent.sh [options] HOST COMMAND...
# With DT_NODES=N (mpirun-nodes.sh sets it), node dtnI runs on its own share of this machine's
# physical cores (cpus.py), as the ranks of separate machines would: without it, each node's
# launcher would place its first rank on the same first core.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
pin=()
idx=${host#dtn}
if [ -n "${DT_NODES:-}" ] && [ "$idx" != "$host" ]; then
  list=$(python3 "$(dirname "$0")/cpus.py" "$idx" "$DT_NODES")
  pin=(taskset -c "$list")
fi
exec ip netns exec "$host" "${pin[@]}" unshare --uts bash -c "hostname $host; $*"
