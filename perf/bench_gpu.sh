#!/usr/bin/env bash
# GPU benchmark, one run on a machine with an NVIDIA GPU (H200 the reference), under 8 minutes:
#   1. builds dt with DT_WITH_CUDA=ON in $DT_BUILD_DIR (default build-gpu/);
#   2. runs the CUDA checks (ctest -R '^gpu\.': plugin load, kernel differential test, NCCL);
#   3. measures the cuBLAS bf16 GEMM rate through the plugin (perf/bench_gpu_gemm.cpp);
#   4. measures dt_train on the CUDA device: tokens/s and model FLOP utilisation of gpt-small in
#      bf16 against that GEMM rate, and the micro config with engine.cuda_graphs against eager
#      launch (steady-state tokens/s of the same run length, one after the other).
# Prints a RESULTS.md section and appends it to perf/RESULTS.md.
# Usage: perf/bench_gpu.sh [steps]
# Needs what a dt build needs (scripts/bootstrap installs it: MPI, HDF5, UCX, hwloc, PMIx, ...)
# besides the CUDA Toolkit and NCCL; a machine without a package registry needs them carried in.
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

gemm=$("$build/bench_gpu_gemm" "$build/plugins/libdt_hal_cuda.so" 8192 8192 8192 bf16 40)
device=$(sed -n 's/^device: //p' <<<"$gemm")
rate=$(sed -n 's/.*, \([0-9.]*\) TFLOP\/s.*/\1/p' <<<"$gemm")

text=/usr/share/common-licenses/GPL-3
run_train() {  # run_train LOG ARGS...: dt_train on the CUDA device; prints its "done" line
  local out=$1; shift
  timeout 300 "$build/apps/dt_train" --runtime.device=cuda --runtime.plugin-path="$build/plugins" \
    --data.path="$text" --train.eval-every=0 "$@" >"$out" 2>&1 || { tail -20 "$out" >&2; return 1; }
  grep -E "^dt_train: done:" "$out" | tail -1
}
# "... N tok/s (steady state), G GFLOP/s per rank ..." -> N or G
tok_of() { sed -n 's/.*, \([0-9.]*\) tok\/s (steady state).*/\1/p' <<<"$1"; }
gflops_of() { sed -n 's/.* \([0-9.]*\) GFLOP\/s per rank.*/\1/p' <<<"$1"; }

# 1. GPT sized for one GPU (gpt-small: 12 x 768, seq 1024, GPT-2's vocabulary of 50257, 124M
#    parameters; the byte text uses its first 256 ids) in bf16: model FLOP utilisation against the
#    cuBLAS bf16 rate measured above. A tenth of the text is held out, so the validation split
#    holds the config's windows of 1025 tokens.
train="not measured: dt_train on cuda/bf16 failed (its last lines are on stderr)"
mfu="?"
if done=$(run_train "$log/small" --config "$root/configs/gpt-small.ini" --train.dtype=bf16 \
    --model.vocab=50257 --data.val-fraction=0.1 \
    --train.batch=8 --train.micro-batch=4 --train.steps="$steps"); then
  tok=$(tok_of "$done"); gf=$(gflops_of "$done")
  train="$tok tok/s, $gf GFLOP/s"
  [ -n "$gf" ] && [ -n "$rate" ] && mfu=$(awk -v g="$gf" -v r="$rate" 'BEGIN{printf "%.1f%%", 100*g/1000/r}')
fi

# 2. CUDA graph replay against eager launch, micro config, same run length, side by side.
graphs="not measured"
ratio="?"
if eager=$(run_train "$log/eager" --config "$root/configs/micro.ini" --train.steps=300) &&
   graph=$(run_train "$log/graph" --config "$root/configs/micro.ini" --train.steps=300 \
     --engine.cuda_graphs=true); then
  te=$(tok_of "$eager"); tg=$(tok_of "$graph")
  graphs="eager $te tok/s, graphs $tg tok/s ($(grep -m1 '^engine.cuda_graphs' "$log/graph"))"
  ratio=$(awk -v a="$te" -v b="$tg" 'BEGIN{printf "%.2fx", b/a}')
fi

cat <<EOT | tee -a "$root/perf/RESULTS.md"

## GPU: cuBLAS bf16 GEMM and training throughput, $(date -u +%F), ${device:-unknown GPU}

Command: \`perf/bench_gpu.sh $steps\`

| what | value |
|---|---|
| CUDA checks (ctest -R '^gpu\\.') | $checks |
| cuBLAS bf16 GEMM 8192^3 through libdt_hal_cuda.so (fp32 accumulation) | ${rate:-?} TFLOP/s |
| dt_train bf16, gpt-small (12 layers x 768, seq 1024, vocab 50257), batch 8 in micro-batches of 4 | $train |
| model FLOP utilisation against the cuBLAS bf16 rate (floor 50%) | $mfu |
| micro config, 300 steps: CUDA graph replay against eager launch | $graphs |
| graph replay speed-up per step (floor 1.3x) | $ratio |

Driver and GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
EOT
