#!/usr/bin/env bash
# retry_mpi_init_crash.sh CMD...: runs a multi-node test once more, and only once, when it failed
# because a rank crashed inside Open MPI's own MPI_Init (the core's backtrace, which the tests
# print through show_cores, runs through ompi_mpi_init): a known crash of Open MPI 4.1.4 on these
# namespaced nodes (about 1 launch in 20, a NULL call from mca_btl_tcp's event handler), before
# any dt code runs. Any other failure, and a second failure of any kind, stands.
set -u
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && grep -q "a process crashed" "$out" &&
   grep -Eq "ompi_mpi_init|PMPI_Init_thread" "$out"; then
  echo "retry_mpi_init_crash.sh: a rank crashed inside Open MPI's MPI_Init (see the backtrace" \
       "above), not in dt: running the test once more"
  "$@"
  rc=$?
fi
exit "$rc"
