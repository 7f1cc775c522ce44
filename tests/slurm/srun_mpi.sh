#!/usr/bin/env bash
# srun_mpi.sh ARGS...: `srun --mpi=pmix ARGS...` inside a multi-node test job (run in the job's
# folder, where ranks leave their core files), launched again, at most twice, only when the
# launch failed and every core file it left shows the known crash of Open MPI 4.1.4 on these
# namespaced nodes (is_mpi_init_crash in cores.sh). The backtrace of each such launch is printed
# (that of a last, failed launch by show_cores). Any other failure stands at once, with its core
# files left for show_cores.
set -u
source "$(dirname "$0")/cores.sh"
attempts=3
stamp=$(mktemp ./.srun-stamp.XXXXXX)
trap 'rm -f "$stamp"' EXIT
for ((attempt = 1; ; attempt++)); do
  touch "$stamp"
  srun --mpi=pmix "$@"
  rc=$?
  [ "$rc" -ne 0 ] && [ "$attempt" -lt "$attempts" ] || exit "$rc"
  cores=() bts=()
  for c in ./core ./core.[0-9]*; do
    [ -f "$c" ] && [ "$c" -nt "$stamp" ] || continue
    bt=$(timeout 30 gdb -batch -ex bt "$(core_exe "$c")" "$c" 2>&1 | grep -E '^#')
    is_mpi_init_crash <<<"$bt" || exit "$rc"
    cores+=("$c") bts+=("$bt")
  done
  [ "${#cores[@]}" -gt 0 ] || exit "$rc"
  for i in "${!cores[@]}"; do
    echo "srun_mpi.sh: launch $attempt of $attempts: a rank crashed inside Open MPI's MPI_Init:"
    sed 's/^/    /' <<<"${bts[$i]}"
    mv "${cores[$i]}" "./mpi-init-crash.$$.$attempt.$i.core"
  done
  echo "srun_mpi.sh: launching again (exit code was $rc)"
done
