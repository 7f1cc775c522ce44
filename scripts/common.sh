# Shared by scripts/demo and scripts/test (sourced, not run).
DT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# dt_build DIR [cmake args...]: configures and builds dt into DIR. A new build folder uses Ninja
# (scripts/bootstrap installs it), which keeps both cores busy to the end of the build; one made
# before keeps the generator it was made with.
dt_build() {
  local dir=$1
  shift
  local generator=()
  if [ ! -f "$dir/CMakeCache.txt" ] && command -v ninja >/dev/null; then
    generator=(-G Ninja)
  fi
  cmake -S "$DT_ROOT" -B "$dir" "${generator[@]}" "$@" >/dev/null
  cmake --build "$dir" -j "$(nproc)"
}

# mpiexec flags for local runs: more ranks than cores is allowed, and root may run ranks.
dt_local_mpi_env() {
  if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  export OMPI_MCA_rmaps_base_oversubscribe=1
}
