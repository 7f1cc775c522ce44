# shellcheck shell=bash
# Helpers of the multi-node Slurm tests (sourced after lib.sh): the cluster is the fixture's
# `scripts/slurm-local up --nodes 2` in STATE_DIR/cluster (its own folder, ports, munge and
# names, so it runs beside the one-node cluster of the other Slurm tests).
export DT_SLURM_DIR=$STATE/cluster
# A rank that crashes leaves a core file in the job's folder (WORK; sbatch and srun pass the limit
# on), and show_cores prints its backtrace: UCX's own handler would print only its own frames.
ulimit -c unlimited 2>/dev/null || true
export UCX_HANDLE_ERRORS=none
# Known here: Open MPI 4.1.4 (Debian 12) now and then crashes in MPI_Init on these nodes (about
# 1 in 20 launches across the two nodes, rank 0 of the first node each time): a NULL function
# called from mca_btl_tcp's event handler inside opal_progress in ompi_mpi_init. The backtrace
# then names it; mpi_add_procs_cutoff=1024 did not prevent it. It waits there for PMIx's modex
# fence while a fragment of a peer already arrives, so that peer got past the fence. Jobs launch
# their ranks through $SRUN (srun_mpi.sh), which launches again after that crash alone.
SRUN=$DT_ROOT/tests/slurm/srun_mpi.sh
source "$DT_ROOT/tests/slurm/cores.sh"

# show_cores: the backtrace of every core file in WORK (renamed so it is shown once), by gdb.
show_cores() {
  local c exe
  for c in "$WORK"/core "$WORK"/core.[0-9]*; do
    [ -f "$c" ] || continue
    exe=$(core_exe "$c")
    echo "=== a process crashed: $(file -b "$c" | cut -c1-200)"
    if command -v gdb >/dev/null && [ -n "$exe" ]; then
      timeout 120 gdb -batch -ex "thread apply all bt 30" "$exe" "$c" 2>&1 |
        grep -E '^(#|Thread|Program terminated)' | head -n 80 | sed 's/^/    /'
    fi
    mv "$c" "$WORK/shown.${c##*/}.$RANDOM"
  done
}

# need_nodes N: need_cluster on the multi-node cluster, which has N nodes; NODE1..N in NODES_LIST.
need_nodes() {
  need_cluster
  mapfile -t NODES_LIST < <("$DT_ROOT/scripts/slurm-local" nodes)
  if [ "${#NODES_LIST[@]}" -ne "$1" ]; then
    echo "FAIL: the cluster has ${#NODES_LIST[@]} nodes (${NODES_LIST[*]}), expected $1"
    exit 1
  fi
  N1=${NODES_LIST[0]}
  N2=${NODES_LIST[1]}
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
}

# job NAME SBATCH_ARGS... -- COMMAND LINE: a batch job running the shell line COMMAND LINE on the
# first node of its allocation (srun in it spreads over the allocation); waits for its end and
# shows its output (NAME.out); the job id in $JOB, its final state in $JOB_END.
# job_script NAME SCRIPT SBATCH_ARGS... -- SCRIPT_ARGS...: the same for `sbatch SCRIPT ARGS`.
job() {
  local name=$1
  shift
  local sargs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do sargs+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  printf '#!/bin/bash\nset -u\n%s\n' "$*" >"$WORK/$name.sh"
  job_script "$name" "$WORK/$name.sh" "${sargs[@]}" --
}
job_script() {
  local name=$1 script=$2 sargs=() out
  shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do sargs+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  echo "=== $name: sbatch ${sargs[*]} $script $*"
  if ! out=$(sbatch --parsable -o "$WORK/$name.out" "${sargs[@]}" "$script" "$@" 2>&1); then
    echo "$out"
    fail "$name: sbatch refused the job"
    JOB="" JOB_END=""
    return 1
  fi
  JOB=${out%%;*}
  JOBS+=("$JOB")
  JOB_END=$(wait_ended "$JOB")
  echo "=== $name: job $JOB ended $JOB_END, exit code $(job_field "$JOB" ExitCode)"
  sed 's/^/    /' "$WORK/$name.out" 2>/dev/null
  show_cores
}

# nodes_healthy: every node up and not drained (a failing prolog or epilog drains it).
nodes_healthy() {
  local n s
  for n in "${NODES_LIST[@]}"; do
    s=$(sinfo -h -n "$n" -o %T | head -n1)
    case "$s" in
      idle* | mixed* | allocated* | completing*) echo "node $n: $s" ;;
      *) fail "node $n is '$s' (a prolog or epilog failed?): $(sinfo -h -n "$n" -o '%T %E')" ;;
    esac
  done
}

# nodes_no_job_groups JOB: on no node a cgroup or QoS record of JOB remains (each node has its
# own cgroup parent CLUSTER-NODE and its own record folder DIR/nodes/NODE/qos).
nodes_no_job_groups() {
  local root cluster left n
  root=$(sed -n "s/^export DT_QOS_CGROUP_ROOT='\\(.*\\)'\$/\\1/p" "$DT_SLURM_DIR/hooks/prolog")
  cluster=$(sed -n 's/^ClusterName=//p' "$SLURM_CONF")
  for n in "${NODES_LIST[@]}"; do
    left=$(find "$root" -maxdepth 4 -type d -path "*/$cluster-$n/job_$1" 2>/dev/null | tr '\n' ' ')
    [ -z "$left" ] || fail "cgroups of job $1 left behind on $n: $left"
    [ ! -e "$DT_SLURM_DIR/nodes/$n/qos/job-$1.conf" ] ||
      fail "QoS record of job $1 left behind on $n"
  done
}

# local_run NAME RANKS ARGS...: dt_train under mpiexec on this machine (one node), step log
# NAME.jsonl.
local_run() {
  local name=$1 ranks=$2
  shift 2
  echo "=== $name: one node, mpiexec -n $ranks dt_train $*"
  timeout -k 10 240 "${MPIEXEC[@]}" -n "$ranks" "$BIN_DIR/dt_train" --config "$CONFIG" \
    --data.path="$TEXT" --train.log-file="$WORK/$name.jsonl" --qos.file=none "$@" >"$name.out" 2>&1
  local rc=$?
  tail -n 3 "$name.out" | sed 's/^/    /'
  [ "$rc" -eq 0 ] || { sed 's/^/    /' "$name.out"; fail "$name: exit code $rc"; }
}
