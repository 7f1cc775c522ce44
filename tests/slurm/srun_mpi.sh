#!/usr/bin/env bash
# srun_mpi.sh ARGS...: `srun --mpi=pmix ARGS...` inside a multi-node test job (run in the job's
# folder, where ranks leave their core files), launched again, at most twice, only when the
# launch failed and every core file it left shows the known crash of Open MPI 4.1.4 on these
# namespaced nodes (nodes_lib.sh): a NULL function called from mca_btl_tcp's event handler inside
# ompi_mpi_init, before MPI_Init returns to dt. The backtrace of each such launch is printed (that
# of a last, failed launch by show_cores). Any other failure stands at once, with its core files
# left for show_cores.
set -u
attempts=3
for ((attempt = 1; ; attempt++)); do
  stamp=$(mktemp ./.srun-stamp.XXXXXX)
  srun --mpi=pmix "$@"
  rc=$?
  if [ "$rc" -eq 0 ] || [ "$attempt" -ge "$attempts" ]; then
    rm -f "$stamp"
    exit "$rc"
  fi
  cores=() bts=()
  for c in ./core ./core.[0-9]*; do
    [ -f "$c" ] && [ "$c" -nt "$stamp" ] || continue
    exe=$(file "$c" | sed -n "s/.*execfn: '\([^']*\)'.*/\1/p")
    bt=$(timeout 30 gdb -batch -ex bt "$exe" "$c" 2>&1 | grep -E '^#')
    grep -q '^#0  0x0000000000000000 in ?? ()' <<<"$bt" &&
      grep -q '^#1 .* from .*/mca_btl_tcp\.so' <<<"$bt" && grep -q ' in ompi_mpi_init ' <<<"$bt" ||
      { rm -f "$stamp"; exit "$rc"; }
    cores+=("$c") bts+=("$bt")
  done
  rm -f "$stamp"
  [ "${#cores[@]}" -gt 0 ] || exit "$rc"
  for i in "${!cores[@]}"; do
    echo "srun_mpi.sh: launch $attempt of $attempts: a rank crashed inside Open MPI's MPI_Init:"
    sed 's/^/    /' <<<"${bts[$i]}"
    mv "${cores[$i]}" "./mpi-init-crash.$$.$attempt.$i.core"
  done
  echo "srun_mpi.sh: launching again (exit code was $rc)"
done
