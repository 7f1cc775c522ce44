#!/usr/bin/env bash
# Real separate "nodes" on one machine: each node is a network namespace with its own hostname
# (UTS namespace), joined by a bridge, so MPI sees separate hosts that talk over TCP.
#   nodes.sh up N      create nodes dtn1..dtnN at 10.77.0.1..N (hostnames dtn1..dtnN)
#   nodes.sh down N    remove them
#   nodes.sh agent     print the path of the rsh agent for mpirun (--mca plm_rsh_agent)
# Needs root (ip netns, unshare). Only touches names and addresses it creates itself.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cmd=${1:?usage: nodes.sh up|down N}
n=${2:-2}
br=dtbr0
case "$cmd" in
  up)
    "$0" down "$n" 2>/dev/null || true
    ip link add "$br" type bridge
    ip link set "$br" up
    ip addr add 10.77.0.254/24 dev "$br"
    for i in $(seq 1 "$n"); do
      ip netns add "dtn$i"
      ip link add "dtv$i" type veth peer name "dtv${i}p"
      ip link set "dtv${i}p" netns "dtn$i"
      ip link set "dtv$i" master "$br"
      ip link set "dtv$i" up
      ip netns exec "dtn$i" ip addr add "10.77.0.$i/24" dev "dtv${i}p"
      ip netns exec "dtn$i" ip link set "dtv${i}p" up
      ip netns exec "dtn$i" ip link set lo up
      grep -q "^10.77.0.$i dtn$i\$" /etc/hosts || echo "10.77.0.$i dtn$i" >> /etc/hosts
    done
    ;;
  down)
    for i in $(seq 1 "$n"); do
      ip netns del "dtn$i" 2>/dev/null || true
      ip link del "dtv$i" 2>/dev/null || true
      sed -i "/^10\.77\.0\.$i dtn$i\$/d" /etc/hosts
    done
    ip link del "$br" 2>/dev/null || true
    ;;
  agent) echo "$here/rsh-agent.sh" ;;
  *) echo "nodes.sh: unknown command '$cmd' (expected up, down or agent)" >&2; exit 2 ;;
esac
