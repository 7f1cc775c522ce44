# shellcheck shell=bash
# Core files of the multi-node tests, sourced by nodes_lib.sh, srun_mpi.sh and
# retry_mpi_init_crash.sh.

# core_exe CORE: the program that left CORE (from file(1)), empty when unknown.
core_exe() {
  file "$1" | sed -n "s/.*execfn: '\([^']*\)'.*/\1/p"
}

# is_mpi_init_crash < TEXT: true when TEXT, gdb backtraces (indented or not), shows the known crash
# of Open MPI 4.1.4 on the namespaced nodes: a NULL function (frame #0 at address 0) called from
# mca_btl_tcp's event handler (frame #1) under ompi_mpi_init, before MPI_Init returns to dt.
is_mpi_init_crash() {
  local bt
  bt=$(sed 's/^ *//')
  grep -q '^#0  0x0000000000000000 in ?? ()' <<<"$bt" &&
    grep -q '^#1 .* from .*/mca_btl_tcp\.so' <<<"$bt" && grep -q ' in ompi_mpi_init ' <<<"$bt"
}
