#!/usr/bin/env bash
# GPU benchmark, one run on a machine with an NVIDIA GPU (H200 the reference), under 8 minutes:
#   1. builds dt with DT_WITH_CUDA=ON in $DT_BUILD_DIR (default build-gpu/);
#   2. runs the CUDA checks (ctest -R '^gpu\.': plugin load, kernel differential test, NCCL);
#   3. measures the cuBLAS bf16 GEMM rate through the plugin (perf/bench_gpu_gemm.cpp);
#   4. measures dt_train tokens/s on the CUDA device in bf16 when dt_train supports it
#      (--runtime.device=cuda --train.dtype=bf16), else says it was not measured.
# Prints a RESULTS.md section on stdout (append it to perf/RESULTS.md by hand after reading it).
# Usage: perf/bench_gpu.sh [steps]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${DT_BUILD_DIR:-$root/build-gpu}
steps=${1:-30}
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDT_WITH_CUDA=ON >"$log/cmake" 2>&1 ||
  { cat "$log/cmake"; exit 1; }
make -C "$build" -j"$(nproc)" dt_hal_cuda dt_cuda_test dt_nccl_test dt_train >"$log/make" 2>&1 ||
  { tail -50 "$log/make"; exit 1; }
g++ -O2 -std=c++17 -I"$root/hal" "$root/perf/bench_gpu_gemm.cpp" -o "$build/bench_gpu_gemm" -ldl

checks="passed"
(cd "$build" && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  ctest -R '^gpu\.' --output-on-failure) >"$log/ctest" 2>&1 || checks="FAILED"
grep -E "tests passed|tests failed|Skipped|SKIP|checks" "$log/ctest" >&2 || true

gemm=$("$build/bench_gpu_gemm" "$build/plugins/libdt_hal_cuda.so" 8192 8192 8192 bf16 20)
device=$(sed -n 's/^device: //p' <<<"$gemm")
rate=$(sed -n 's/.*, \([0-9.]*\) TFLOP\/s$/\1/p' <<<"$gemm")

train="not measured: dt_train does not accept --runtime.device=cuda --train.dtype=bf16 yet"
if "$build/apps/dt_train" --help 2>/dev/null | grep -q "train.dtype"; then
  cfg="$root/configs/gpt-small.ini"
  if [ -f "$cfg" ] && out=$(timeout 300 "$build/apps/dt_train" --config "$cfg" \
      --runtime.device=cuda --runtime.plugin-path="$build/plugins" --train.dtype=bf16 \
      --train.steps="$steps" --train.eval-every=0 --data.path=/usr/share/common-licenses/GPL-3 2>&1); then
    tok=$(grep -oE "[0-9.]+ tok/s" <<<"$out" | tail -1 || true)
    train="${tok:-ran, but printed no tok/s figure}"
  else
    tail -20 <<<"${out:-}" >&2
    train="not measured: dt_train on cuda/bf16 failed (its last lines are on stderr)"
  fi
fi

cat <<EOT
## GPU: cuBLAS bf16 GEMM and training throughput, $(date -u +%F), ${device:-unknown GPU}

Command: \`perf/bench_gpu.sh $steps\`

| what | value |
|---|---|
| CUDA checks (ctest -R '^gpu\\.') | $checks |
| cuBLAS bf16 GEMM 8192^3 through libdt_hal_cuda.so (fp32 accumulation) | ${rate:-?} TFLOP/s |
| dt_train bf16, 12 layers x 768, seq 1024 | $train |
EOT
