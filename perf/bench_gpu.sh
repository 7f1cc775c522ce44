#!/usr/bin/env bash
# GPU benchmark, one run on a machine with an NVIDIA GPU (H200 the reference), under 8 minutes:
#   1. builds dt with DT_WITH_CUDA=ON in $DT_BUILD_DIR (default build-gpu/), or, with
#      DT_GPU_PAYLOAD=ARCHIVE, unpacks what perf/gpu_payload.sh built elsewhere and runs it through
#      its dtenv (for a GPU machine that lacks dt's other dependencies: MPI, HDF5, UCX, ...);
#   2. runs the CUDA checks (what ctest -R '^gpu\.' runs: plugin load, kernel differential test,
#      the same with the opt-in paths DT_CUDA_LT=1 DT_CUDA_FLASH=tiled, NCCL on 1 and 2 ranks),
#      each passing or skipping with exit 77;
#   3. measures the cuBLAS bf16 GEMM rate through the plugin (perf/bench_gpu_gemm.cpp);
#   4. measures dt_train on the CUDA device: tokens/s and model FLOP utilisation of gpt-small in
#      bf16 against that GEMM rate (the head padded to 50304, model.pad-vocab=64; the model FLOPs
#      count the 50257 real ones), the padded head against the unpadded one, attention keeping
#      its probabilities against flash attention (model.attention) and the plugin's opt-in paths
#      (tiled flash kernels, cuBLASLt) against its defaults, with batch 16 in one micro-batch too,
#      and the micro config with engine.cuda_graphs against eager
#      launch (steady-state tokens/s of the same run length, one after the other), on the fused
#      model and through the stage engine, and gpt-tiny in bf16 with the weights' 16-bit copy
#      against casting them for every product.
# Prints a RESULTS.md section and appends it to perf/RESULTS.md ($DT_GPU_RESULTS names another
# file); each figure is said on stderr as it is measured; the full logs of the checks and runs go
# to $DT_GPU_LOGS when set. Each check and each dt_train run is stopped after
# $DT_GPU_TIMEOUT seconds (default 300).
# Usage: perf/bench_gpu.sh [steps]
# Building needs what a dt build needs (scripts/bootstrap installs it) besides the CUDA Toolkit
# and NCCL.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/perf/gpu_lib.sh"
steps=${1:-30}
log=$(mktemp -d)
trap 'if [ -n "${DT_GPU_LOGS:-}" ]; then mkdir -p "$DT_GPU_LOGS"; cp -r "$log"/*.log "$DT_GPU_LOGS"/ 2>/dev/null || true; fi; rm -rf "$log"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

if [ -n "${DT_GPU_PAYLOAD:-}" ]; then
  [ -f "$DT_GPU_PAYLOAD" ] ||
    { echo "bench_gpu: DT_GPU_PAYLOAD=$DT_GPU_PAYLOAD is not a file (perf/gpu_payload.sh makes it)" >&2; exit 2; }
  payload=$(realpath "$DT_GPU_PAYLOAD")
  tar -C "$log" -xJf "$payload"
  run=("$log/dt/dtenv")
  bin=$log/dt/bin
  plugins=$log/dt/plugins
  text=$log/dt/share/train.txt
  mpiexec=mpirun
  built="payload $(basename "$DT_GPU_PAYLOAD")"
else
  build=${DT_BUILD_DIR:-$root/build-gpu}
  dt_gpu_build "$build" "$log"
  run=(env)
  bin=$build/bin
  plugins=$build/plugins
  text=/usr/share/common-licenses/GPL-3
  mpiexec=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt")
  built="built in $build"
fi

dt_gpu_checks "$log" "$mpiexec" "$bin" "${run[@]}"
if [ -n "$DT_GPU_FAILED" ]; then checks="FAILED:$DT_GPU_FAILED"
elif [ -n "$DT_GPU_SKIPPED" ]; then checks="passed; skipped (SKIP lines on stderr):$DT_GPU_SKIPPED"
else checks="passed"; fi

gemm=$("${run[@]}" "$bin/bench_gpu_gemm" "$plugins/libdt_hal_cuda.so" 8192 8192 8192 bf16 40) || gemm=""
device=$(sed -n 's/^device: //p' <<<"$gemm")
rate=$(sed -n 's/.*, \([0-9.]*\) TFLOP\/s.*/\1/p' <<<"$gemm")
echo "bench_gpu: cuBLAS bf16 GEMM 8192^3: ${rate:-?} TFLOP/s" >&2

# run_train NAME ARGS...: dt_train on the CUDA device, its output in $log/NAME.log; prints its
# "done" line, and says it on stderr too, so that a run cut short still shows what it measured.
run_train() {
  local name=$1 out=$log/$1.log done
  shift
  timeout "${DT_GPU_TIMEOUT:-300}" "${run[@]}" "$bin/dt_train" --runtime.device=cuda --runtime.plugin-path="$plugins" \
    --data.path="$text" --train.eval-every=0 "$@" >"$out" 2>&1 ||
    { tail -20 "$out" >&2; echo "bench_gpu: $name: dt_train failed" >&2; return 1; }
  done=$(grep -E "^dt_train: done:" "$out" | tail -1) || true
  [ -n "$done" ] || { tail -20 "$out" >&2; echo "bench_gpu: $name: no 'dt_train: done:' line" >&2; return 1; }
  echo "bench_gpu: $name (${DT_CUDA_FLASH:+DT_CUDA_FLASH=$DT_CUDA_FLASH }${DT_CUDA_LT:+DT_CUDA_LT=$DT_CUDA_LT }${DT_CUDA_LT_TUNE:+DT_CUDA_LT_TUNE=$DT_CUDA_LT_TUNE }$*): $done" >&2
  echo "$done"
}
# "... N tok/s (steady state), G GFLOP/s per rank ..." -> N or G
tok_of() { sed -n 's/.*, \([0-9.]*\) tok\/s (steady state).*/\1/p' <<<"$1"; }
gflops_of() { sed -n 's/.* \([0-9.]*\) GFLOP\/s per rank.*/\1/p' <<<"$1"; }

# 1. GPT sized for one GPU (gpt-small: 12 x 768, seq 1024, GPT-2's vocabulary of 50257, 124M
#    parameters; the byte text uses its first 256 ids) in bf16: model FLOP utilisation against the
#    cuBLAS bf16 rate measured above. A tenth of the text is held out, so the validation split
#    holds the config's windows of 1025 tokens.
mfu_of() {  # "... G GFLOP/s ..." -> MFU against the cuBLAS rate
  local gf
  gf=$(gflops_of "$1")
  [ -n "$gf" ] && [ -n "$rate" ] && awk -v g="$gf" -v r="$rate" 'BEGIN{if (r + 0 > 0) printf "%.1f%%", 100*g/1000/r; else printf "?"}'
}
train="not measured: dt_train on cuda/bf16 failed (its last lines are on stderr)"
mfu="?"
small_model=(--config "$root/configs/gpt-small.ini" --train.dtype=bf16 --model.vocab=50257
             --data.val-fraction=0.1 --train.steps="$steps")
small=("${small_model[@]}" --train.batch=8 --train.micro-batch=4)
if done=$(run_train small "${small[@]}" --model.pad-vocab=64); then
  tok=$(tok_of "$done"); gf=$(gflops_of "$done")
  train="$tok tok/s, $gf GFLOP/s"
  mfu=$(mfu_of "$done") || mfu="?"
fi

# vs_small NAME ARGS...: tok/s of gpt-small with ARGS (which name model.pad-vocab; the plugin's
# opt-in paths through the environment), run after the one above (padded, flash attention on the
# plugin's default kernels, cublasGemmEx) with the same run length; its log is $log/NAME.log.
# (A local named log would hide the log folder from run_train.) ratio_of X Y: "X/Y".
base_tok=$(tok_of "${done:-}")
vs_small() {
  local name=$1 a
  shift
  [ -n "$base_tok" ] || return 1
  a=$(run_train "$name" "${small[@]}" "$@") || return 1
  a=$(tok_of "$a")
  [ -n "$a" ] || return 1
  echo "$a"
}
ratio_of() { awk -v x="$1" -v y="$2" 'BEGIN{if (y + 0 > 0) printf "%.2fx", x/y; else printf "?"}'; }

# 1b. The head over 50257 columns (no dimension of the vocabulary's products a multiple of 8)
#     against 50304.
padded="not measured"
padratio="?"
if t=$(vs_small small_unpadded --model.pad-vocab=0); then
  padded="vocabulary 50257 $t tok/s, padded to 50304 $base_tok tok/s"
  padratio=$(ratio_of "$base_tok" "$t")
fi

# 1c. Attention keeping its T x T probabilities (model.attention=full) against one log-sum-exp per
#     row (flash, the default), and flash on the tiled tensor-core kernels (DT_CUDA_FLASH=tiled).
flash="not measured"
flashratio="?"
if t=$(vs_small small_full --model.pad-vocab=64 --model.attention=full); then
  flash="full $t tok/s, flash $base_tok tok/s"
  flashratio=$(ratio_of "$base_tok" "$t")
  if tt=$(DT_CUDA_FLASH=tiled vs_small small_tiled --model.pad-vocab=64); then
    flash="$flash, flash tiled $tt tok/s"
    flashratio="$flashratio, tiled $(ratio_of "$tt" "$t")"
  fi
fi

# 1d. The 16-bit products through cuBLASLt's heuristic (DT_CUDA_LT=1) and with its algorithms
#     timed per shape (DT_CUDA_LT_TUNE=1) against cublasGemmEx (the default).
lt="not measured"
ltratio="?"
if t=$(DT_CUDA_LT=1 vs_small small_lt --model.pad-vocab=64); then
  lt="cublasGemmEx $base_tok tok/s, cuBLASLt $t tok/s"
  ltratio=$(ratio_of "$t" "$base_tok")
  if tt=$(DT_CUDA_LT=1 DT_CUDA_LT_TUNE=1 vs_small small_lt_tuned --model.pad-vocab=64); then
    lt="$lt, cuBLASLt timed $tt tok/s"
    ltratio="$ltratio, timed $(ratio_of "$tt" "$base_tok")"
  fi
fi

# 1e. Both opt-in paths together, and then also larger micro-batches, which flash attention's
#     smaller activations allow: batch 16 in one micro-batch (products of 16384 rows).
both="not measured"
bothmfu="?"
big="not measured"
bigmfu="?"
if d=$(DT_CUDA_FLASH=tiled DT_CUDA_LT=1 run_train small_new "${small[@]}" --model.pad-vocab=64); then
  both="$(tok_of "$d") tok/s, $(gflops_of "$d") GFLOP/s"
  bothmfu=$(mfu_of "$d") || bothmfu="?"
fi
if d=$(DT_CUDA_FLASH=tiled DT_CUDA_LT=1 run_train small_big "${small_model[@]}" \
    --model.pad-vocab=64 --train.batch=16 --train.micro-batch=16); then
  big="$(tok_of "$d") tok/s, $(gflops_of "$d") GFLOP/s"
  bigmfu=$(mfu_of "$d") || bigmfu="?"
fi

# compare LOG_A OPTION_A LOG_B OPTION_B OPTIONS...: dt_train with OPTIONS and OPTION_A, then with
# OPTIONS and OPTION_B (same run length, one after the other): "A tok/s|B tok/s|B/A".
compare() {
  local la=$1 oa=$2 lb=$3 ob=$4 a b ta tb
  shift 4
  a=$(run_train "$la" "$@" "$oa") && b=$(run_train "$lb" "$@" "$ob") || return 1
  ta=$(tok_of "$a"); tb=$(tok_of "$b")
  printf '%s|%s|%s\n' "$ta" "$tb" "$(ratio_of "$tb" "$ta")"
}
micro=(--config "$root/configs/micro.ini" --train.steps=300)

# 2. CUDA graph replay against eager launch, micro config.
graphs="not measured"
ratio="?"
if r=$(compare eager --engine.cuda_graphs=false graph --engine.cuda_graphs=true "${micro[@]}"); then
  IFS='|' read -r te tg ratio <<<"$r"
  graphs="eager $te tok/s, graphs $tg tok/s ($(grep -m1 '^engine.cuda_graphs' "$log/graph.log"))"
fi

# 3. The same through the stage engine (parallel.engine=graph, one rank) in bf16: a graph per
#    stretch of device work between the pass's host points, with the 16-bit attention and GEMM
#    scratch of the CUDA device.
egraphs="not measured"
eratio="?"
if r=$(compare engine_eager --engine.cuda_graphs=false engine_graph --engine.cuda_graphs=true \
    "${micro[@]}" --parallel.engine=graph --train.dtype=bf16); then
  IFS='|' read -r te tg eratio <<<"$r"
  egraphs="eager $te tok/s, graphs $tg tok/s ($(grep -m1 '^engine.cuda_graphs' "$log/engine_graph.log"))"
fi

# 4. bf16 matrix products reading the weights' 16-bit copy against casting the weights for every
#    product (test.cast-weights), gpt-tiny.
w16="not measured"
w16ratio="?"
if r=$(compare w16_cast --test.cast-weights=true w16_copy --test.cast-weights=false \
    --config "$root/configs/gpt-tiny.ini" --train.steps=100 --train.dtype=bf16); then
  IFS='|' read -r tc tw w16ratio <<<"$r"
  w16="cast per product $tc tok/s, 16-bit copy $tw tok/s"
fi

# Figures go into RESULTS.md only from a machine whose GPU passed the kernel test, on the
# default paths and on the opt-in ones (whose figures the table holds too).
results_file=${DT_GPU_RESULTS:-$root/perf/RESULTS.md}
results=$results_file
[[ " $DT_GPU_PASSED " == *" cuda_kernels "* && " $DT_GPU_PASSED " == *" cuda_kernels.tiled_lt "* ]] ||
  results=/dev/null
cat <<EOT | tee -a "$results"

## GPU: cuBLAS bf16 GEMM and training throughput, $(date -u +%F), ${device:-unknown GPU}

Command: \`${DT_GPU_PAYLOAD:+DT_GPU_PAYLOAD=$DT_GPU_PAYLOAD }perf/bench_gpu.sh $steps\` ($built)

| what | value |
|---|---|
| CUDA checks (plugin load, kernels, kernels on the opt-in tiled flash and cuBLASLt, NCCL on 1 and 2 ranks) | $checks |
| cuBLAS bf16 GEMM 8192^3 through libdt_hal_cuda.so (fp32 accumulation) | ${rate:-?} TFLOP/s |
| dt_train bf16, gpt-small (12 layers x 768, seq 1024, vocab 50257, head padded to 50304), batch 8 in micro-batches of 4 | $train |
| model FLOP utilisation against the cuBLAS bf16 rate (floor 50%) | $mfu |
| gpt-small: the head over the vocabulary as it is against padded (model.pad-vocab=64) | $padded |
| padded head speed-up per step | $padratio |
| gpt-small padded: attention keeping its probabilities against flash attention (model.attention), and flash on the tiled kernels (DT_CUDA_FLASH=tiled) | $flash |
| flash attention speed-up per step (over full) | $flashratio |
| gpt-small padded: products through cublasGemmEx, cuBLASLt's heuristic (DT_CUDA_LT=1), cuBLASLt timed per shape (DT_CUDA_LT_TUNE=1) | $lt |
| cuBLASLt speed-up per step over cublasGemmEx | $ltratio |
| gpt-small padded with tiled flash and cuBLASLt | $both |
| its model FLOP utilisation against the cuBLAS bf16 rate (floor 50%) | $bothmfu |
| the same with batch 16 in one micro-batch | $big |
| its model FLOP utilisation | $bigmfu |
| micro config, 300 steps: CUDA graph replay against eager launch | $graphs |
| graph replay speed-up per step (floor 1.3x) | $ratio |
| the same through the stage engine (parallel.engine=graph), bf16 | $egraphs |
| stage-engine graph replay speed-up per step | $eratio |
| gpt-tiny bf16, 100 steps: weights cast per product against their 16-bit copy | $w16 |
| 16-bit weight copy speed-up per step | $w16ratio |

Driver and GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
EOT
[ "$results" != /dev/null ] ||
  echo "bench_gpu: the kernel test did not pass on a GPU: $results_file left as it was" >&2
[ -z "$DT_GPU_FAILED" ] || { echo "bench_gpu: failed:$DT_GPU_FAILED" >&2; exit 1; }
