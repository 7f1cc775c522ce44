#!/usr/bin/env bash
# mpirun-nodes.sh NODES RANKS_PER_NODE PROGRAM [ARGS...]
# Creates NODES namespace nodes (nodes.sh), runs PROGRAM on NODES x RANKS_PER_NODE ranks across
# them with mpirun over TCP, removes the nodes, and returns PROGRAM's exit code. Each node runs on
# its own share of the machine's CPUs (rsh-agent.sh), so mpirun binds nothing itself: it would put
# every node's first rank on the same core.
# Exits 77 (skipped) when not root or when this machine cannot make network namespaces and
# bridges at all; once it can, a failure to set the nodes up fails the test.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
nodes=$1
per=$2
shift 2
if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null || ! command -v unshare >/dev/null; then
  echo "mpirun-nodes.sh: needs root, ip and unshare; skipped"
  exit 77
fi
probe=dtprobe$$
if ! unshare --net --uts true 2>/dev/null || ! ip link add "$probe" type bridge 2>/dev/null; then
  echo "mpirun-nodes.sh: this machine cannot create network namespaces and bridges; skipped"
  exit 77
fi
ip link del "$probe"
trap '"$here/nodes.sh" down "$nodes"' EXIT
if ! "$here/nodes.sh" up "$nodes"; then
  echo "mpirun-nodes.sh: FAIL: could not set up $nodes namespace nodes (see above)"
  exit 1
fi
hosts=""
for i in $(seq 1 "$nodes"); do hosts+="${hosts:+,}dtn$i:$per"; done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 DT_NODES=$nodes
timeout 240 mpirun --oversubscribe --host "$hosts" -n $((nodes * per)) \
  --mca plm_rsh_agent "$here/rsh-agent.sh" \
  --mca oob_tcp_if_include 10.77.0.0/24 --mca btl_tcp_if_include 10.77.0.0/24 \
  --mca btl self,vader,tcp --bind-to none "$@"
