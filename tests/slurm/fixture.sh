#!/usr/bin/env bash
# ctest fixture of the Slurm tests: fixture.sh up|down DT_ROOT STATE_DIR [NODES]
#   up    starts the local cluster (scripts/slurm-local up) unless one runs already; where Slurm
#         cannot be installed, or this is not root, writes STATE_DIR/unavailable with the reason
#         (the tests then skip, naming it) and succeeds.
#   down  stops the cluster if `up` started it.
# With NODES (2 or more) the cluster is `scripts/slurm-local up --nodes NODES` in its own folder
# STATE_DIR/cluster, beside the one-node cluster; where network namespaces cannot be made, the
# tests skip.
set -u
[ $# -eq 3 ] || [ $# -eq 4 ] || { echo "usage: $0 up|down DT_ROOT STATE_DIR [NODES]" >&2; exit 2; }
action=$1
root=$2
state=$3
nodes=${4:-}
local_slurm=$root/scripts/slurm-local
up_args=()
if [ -n "$nodes" ]; then
  export DT_SLURM_DIR=$state/cluster
  up_args=(--nodes "$nodes")
fi
mkdir -p "$state"

case "$action" in
  up)
    rm -f "$state/unavailable" "$state/started-here"
    if [ "$(id -u)" -ne 0 ]; then
      echo "slurm tests: skipped: they need root (slurmd, the prolog and the epilog run as root)" |
        tee "$state/unavailable"
      exit 0
    fi
    if [ -n "$nodes" ] && ! { command -v ip && command -v nsenter && unshare --net --uts true; } \
      >/dev/null 2>&1; then
      echo "slurm tests: skipped: network namespaces cannot be made here (ip, nsenter, unshare)" |
        tee "$state/unavailable"
      exit 0
    fi
    if "$local_slurm" status; then
      echo "slurm tests: using the local cluster that already runs"
      exit 0
    fi
    if "$local_slurm" up "${up_args[@]}"; then
      touch "$state/started-here"
      exit 0
    fi
    # Not installable (no package source reachable, not Debian...) is a skip; installed but not
    # starting is a failure.
    for b in munged slurmctld slurmd sbatch; do
      if ! command -v "$b" >/dev/null 2>&1; then
        echo "slurm tests: skipped: Slurm could not be installed ($b missing after" \
          "scripts/bootstrap --slurm)" | tee "$state/unavailable"
        exit 0
      fi
    done
    echo "slurm tests: Slurm is installed but the local cluster did not start (see above)"
    exit 1
    ;;
  down)
    rm -f "$state/unavailable"
    if [ -f "$state/started-here" ]; then
      rm -f "$state/started-here"
      "$local_slurm" down
    else
      echo "slurm tests: the local cluster was running before the tests; left running"
    fi
    ;;
  *)
    echo "usage: $0 up|down DT_ROOT STATE_DIR" >&2
    exit 2
    ;;
esac
