#!/usr/bin/env bash
# retry_mpi_init_crash.sh CMD...: runs a multi-node test once more, and only once, when it failed
# because a rank crashed inside Open MPI's own MPI_Init: the core's backtrace, which the tests
# print through show_cores, shows the known crash of Open MPI 4.1.4 on these namespaced nodes
# (about 1 launch in 20; is_mpi_init_crash in cores.sh). Launches through srun_mpi.sh are already
# made again after it; this covers the others (slurm/train.sbatch's srun, mpiexec). Any other
# failure, and a second failure of any kind, stands.
set -u
source "$(dirname "$0")/cores.sh"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && grep -q "a process crashed" "$out" &&
   is_mpi_init_crash <"$out"; then
  echo "retry_mpi_init_crash.sh: a rank crashed inside Open MPI's MPI_Init (see the backtrace" \
       "above), not in dt: running the test once more"
  "$@"
  rc=$?
fi
exit "$rc"
