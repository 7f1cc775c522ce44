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

# For perf/ benchmarks: builds a Release dt without tests in $DT_BUILD_DIR (default
# build-release/), leaves its path in `build`, and sets the local MPI environment.
dt_bench_build() {
  build=${DT_BUILD_DIR:-$DT_ROOT/build-release}
  dt_build "$build" -DCMAKE_BUILD_TYPE=Release -DDT_BUILD_TESTS=OFF >/dev/null
  dt_local_mpi_env
}

# mpiexec flags for local runs: more ranks than cores is allowed, and root may run ranks.
dt_local_mpi_env() {
  if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  export OMPI_MCA_rmaps_base_oversubscribe=1
}
