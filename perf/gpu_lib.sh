# Shared by perf/bench_gpu.sh, perf/gpu_payload.sh and perf/gpu_payload_check.sh (sourced).

# dt_gpu_build DIR LOGDIR: configures dt with DT_WITH_CUDA=ON (Release) in DIR, builds what the
# GPU checks and benchmark run (dt_train, the CUDA plugin, the NCCL communicator, the GPU tests, perf/bench_gpu_gemm) and
# links the four programs into DIR/bin. Logs go to LOGDIR; on failure their tail is printed.
dt_gpu_build() {
  local dir=$1 logs=$2 src
  src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  cmake -S "$src" -B "$dir" -DCMAKE_BUILD_TYPE=Release -DDT_WITH_CUDA=ON >"$logs/cmake.log" 2>&1 ||
    { cat "$logs/cmake.log" >&2; echo "configuring $dir failed" >&2; return 1; }
  cmake --build "$dir" -j"$(nproc)" --target dt_hal_cuda dt_nccl dt_cuda_test dt_nccl_test dt_train \
    >"$logs/build.log" 2>&1 ||
    { tail -50 "$logs/build.log" >&2; echo "building in $dir failed" >&2; return 1; }
  # Each step returns on failure itself: a caller's `||` turns errexit off in here.
  g++ -O2 -std=c++17 -I"$src/hal" "$src/perf/bench_gpu_gemm.cpp" -o "$dir/bench_gpu_gemm" -ldl ||
    return 1
  mkdir -p "$dir/bin" || return 1
  ln -sf "$dir/apps/dt_train" "$dir/tests/gpu/dt_cuda_test" "$dir/tests/gpu/dt_nccl_test" \
    "$dir/bench_gpu_gemm" "$dir/bin/"
}

# dt_gpu_checks LOGDIR MPIEXEC BIN RUN...: what ctest -R '^gpu\.' runs (the CUDA plugin's load
# test, the kernel differential test, also on the plugin's opt-in paths, NCCL on 1 and 2 ranks), the programs taken from BIN and each
# started through RUN... (a wrapper such as a payload's dtenv, or env) within $DT_GPU_TIMEOUT
# seconds (default 300). Each passes (exit 0) or skips (exit 77 with a SKIP line); a line per
# check goes to stderr and its whole output to LOGDIR/check-NAME.log. Sets DT_GPU_PASSED, DT_GPU_SKIPPED and DT_GPU_FAILED to the
# names, space-separated.
dt_gpu_checks() {
  local logs=$1 mpiexec=$2 bin=$3
  shift 3
  DT_GPU_PASSED="" DT_GPU_SKIPPED="" DT_GPU_FAILED=""
  local name rc log
  for name in cuda_plugin_load cuda_kernels cuda_kernels.tiled_lt nccl.n1 nccl.n2; do
    log=$logs/check-$name.log
    rc=0
    case $name in
      cuda_plugin_load) timeout "${DT_GPU_TIMEOUT:-300}" "$@" "$bin/dt_cuda_test" --load ;;
      cuda_kernels) timeout "${DT_GPU_TIMEOUT:-300}" "$@" "$bin/dt_cuda_test" ;;
      # The same with the plugin's opt-in paths: cuBLASLt for the 16-bit products, and flash
      # attention on the tiled tensor-core kernels.
      cuda_kernels.tiled_lt)
        DT_CUDA_LT=1 DT_CUDA_FLASH=tiled timeout "${DT_GPU_TIMEOUT:-300}" "$@" "$bin/dt_cuda_test" ;;
      nccl.n*) timeout "${DT_GPU_TIMEOUT:-300}" "$@" "$mpiexec" -n "${name#nccl.n}" "$bin/dt_nccl_test" ;;
    esac >"$log" 2>&1 || rc=$?
    if [ $rc = 0 ]; then
      echo "$name: passed" >&2
      DT_GPU_PASSED="$DT_GPU_PASSED $name"
    elif [ $rc = 77 ] && grep -q SKIP "$log"; then
      echo "$name: $(grep -m1 SKIP "$log")" >&2
      DT_GPU_SKIPPED="$DT_GPU_SKIPPED $name"
    else
      tail -40 "$log" >&2
      echo "$name: FAILED (exit $rc)" >&2
      DT_GPU_FAILED="$DT_GPU_FAILED $name"
    fi
  done
}
