#!/usr/bin/env bash
# rsh agent for mpirun: "ssh" into namespace node HOST = run the command inside netns HOST with
# hostname HOST. mpirun calls it as: rsh-agent.sh [options] HOST COMMAND...
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
exec ip netns exec "$host" unshare --uts bash -c "hostname $host; $*"
