#!/usr/bin/env bash
# perf/bench_gpu.sh's own logic, on any machine: it runs on a payload whose programs are stand-ins
# (a dt_train that answers with a rate made from its options, kernel and NCCL tests that pass or
# skip as told, a GEMM benchmark with a fixed rate), and every figure of its table must come out
# of the runs it should have made, as the ratios of those rates. A GPU session has minutes for
# one run of the script, so a figure it would lose must be found here.
# Case A: the checks pass; the section goes to DT_GPU_RESULTS with every figure.
# Case B: the kernel test fails; the script exits 1 and leaves DT_GPU_RESULTS as it was.
# Case C: one dt_train run ends well without its "done" line; that row alone is not measured.
# mpirun is a stand-in too (it sets OMPI_COMM_WORLD_SIZE from -n), so no MPI is needed.
# Usage: bench_script.sh ROOT
set -euo pipefail
root=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "bench_script: FAIL: $*" >&2; exit 1; }
unset DT_CUDA_FLASH DT_CUDA_LT DT_CUDA_LT_TUNE DT_GPU_LOGS DT_GPU_RESULTS
mkdir -p "$work/bin"
cat >"$work/bin/mpirun" <<'EOF'
#!/bin/sh
[ "$1" = -n ] || { echo "stand-in mpirun: expected -n N PROGRAM" >&2; exit 2; }
n=$2
shift 2
OMPI_COMM_WORLD_SIZE=$n exec "$@"
EOF
chmod +x "$work/bin/mpirun"
export PATH=$work/bin:$PATH

mkdir -p "$work/p/dt/bin" "$work/p/dt/plugins" "$work/p/dt/share"
printf '#!/bin/sh\nexec "$@"\n' >"$work/p/dt/dtenv"
echo "stand-in" >"$work/p/dt/plugins/libdt_hal_cuda.so"
echo "text" >"$work/p/dt/share/train.txt"
cat >"$work/p/dt/bin/dt_cuda_test" <<'EOF'
#!/bin/sh
[ -z "${STUB_KERNELS_FAIL:-}" ] || [ "${1:-}" = --load ] || { echo "kernel mismatch"; exit 1; }
echo "ok"
EOF
cat >"$work/p/dt/bin/dt_nccl_test" <<'EOF'
#!/bin/sh
[ "${OMPI_COMM_WORLD_SIZE:-1}" = 1 ] || { echo "SKIP: one GPU here"; exit 77; }
echo "ok"
EOF
cat >"$work/p/dt/bin/bench_gpu_gemm" <<'EOF'
#!/bin/sh
echo "device: Stand-in GPU, sm_90"
echo "gemm bf16 8192x8192x8192: 2.000 ms per call, 500.0 TFLOP/s (median of 5 rounds of 40)"
EOF
# tok/s: 1000, times what each option or setting is worth; GFLOP/s = 100 x tok/s. Each run is
# listed in $STUB_RUNS.
cat >"$work/p/dt/bin/dt_train" <<'EOF'
#!/bin/sh
tok=1000
case " $* " in *" --model.pad-vocab=0 "*) [ -z "${STUB_UNPADDED_SILENT:-}" ] || exit 0 ;; esac
for a in "$@"; do
  case $a in
    --model.pad-vocab=0) tok=$((tok * 8 / 10)) ;;
    --model.attention=full) tok=$((tok / 2)) ;;
    --train.micro-batch=16) tok=$((tok * 2)) ;;
    --engine.cuda_graphs=true) tok=$((tok * 3)); echo "engine.cuda_graphs: 1 capture(s)" ;;
    --test.cast-weights=true) tok=$((tok * 7 / 10)) ;;
  esac
done
[ "${DT_CUDA_FLASH:-}" != tiled ] || tok=$((tok + 200))
[ "${DT_CUDA_LT:-}" != 1 ] || tok=$((tok + 50))
[ "${DT_CUDA_LT_TUNE:-}" != 1 ] || tok=$((tok + 30))
echo "${DT_CUDA_FLASH:-} ${DT_CUDA_LT:-} ${DT_CUDA_LT_TUNE:-} $*" >>"$STUB_RUNS"
echo "dt_train: done: 30 steps, loss 1.0, $tok tok/s (steady state), $((tok * 100)) GFLOP/s per rank"
EOF
chmod +x "$work/p/dt/dtenv" "$work/p/dt/bin/"*
tar -C "$work/p" -cJf "$work/payload.tar.xz" dt

export STUB_RUNS=$work/runs DT_GPU_PAYLOAD=$work/payload.tar.xz DT_GPU_TIMEOUT=60
echo "earlier results" >"$work/results.md"

# Case A.
rc=0
DT_GPU_RESULTS=$work/results.md DT_GPU_LOGS=$work/logs "$root/perf/bench_gpu.sh" 30 \
  >"$work/out" 2>"$work/err" || rc=$?
cat "$work/err" >&2
[ "$rc" = 0 ] || { cat "$work/out"; fail "case A: exit $rc, expected 0"; }
row() {  # row TEXT: the value of the table row whose first cell begins with TEXT
  awk -F' [|] ' -v t="| $1" 'index($0, t) == 1 { sub(/ [|]$/, "", $2); print $2; exit }' \
    "$work/results.md"
}
expect() {  # expect ROW VALUE
  local got
  got=$(row "$1")
  [ "$got" = "$2" ] || fail "case A: row '$1': '$got', expected '$2'"
}
grep -q '^earlier results$' "$work/results.md" || fail "case A: the earlier results were lost"
grep -q '^## GPU: cuBLAS bf16 GEMM and training throughput, .*Stand-in GPU' "$work/results.md" ||
  fail "case A: no section naming the device in DT_GPU_RESULTS"
expect "CUDA checks" "passed; skipped (SKIP lines on stderr): nccl.n2"
expect "cuBLAS bf16 GEMM 8192^3" "500.0 TFLOP/s"
expect "dt_train bf16, gpt-small" "1000 tok/s, 100000 GFLOP/s"
expect "model FLOP utilisation against" "20.0%"
expect "gpt-small: the head over the vocabulary" \
  "vocabulary 50257 800 tok/s, padded to 50304 1000 tok/s"
expect "padded head speed-up" "1.25x"
expect "gpt-small padded: attention keeping" "full 500 tok/s, flash 1000 tok/s, flash tiled 1200 tok/s"
expect "flash attention speed-up" "2.00x, tiled 2.40x"
expect "gpt-small padded: products through" \
  "cublasGemmEx 1000 tok/s, cuBLASLt 1050 tok/s, cuBLASLt timed 1080 tok/s"
expect "cuBLASLt speed-up" "1.05x, timed 1.08x"
expect "gpt-small padded with tiled flash and cuBLASLt" "1250 tok/s, 125000 GFLOP/s"
expect "its model FLOP utilisation against" "25.0%"
expect "the same with batch 16" "2250 tok/s, 225000 GFLOP/s"
expect "its model FLOP utilisation |" "45.0%"
expect "micro config, 300 steps" "eager 1000 tok/s, graphs 3000 tok/s (engine.cuda_graphs: 1 capture(s))"
expect "graph replay speed-up" "3.00x"
expect "the same through the stage engine" \
  "eager 1000 tok/s, graphs 3000 tok/s (engine.cuda_graphs: 1 capture(s))"
expect "stage-engine graph replay" "3.00x"
expect "gpt-tiny bf16, 100 steps" "cast per product 700 tok/s, 16-bit copy 1000 tok/s"
expect "16-bit weight copy" "1.43x"
runs=$(wc -l <"$work/runs")
[ "$runs" = 14 ] || { cat "$work/runs" >&2; fail "case A: $runs dt_train runs, expected 14"; }
for name in check-cuda_kernels check-cuda_kernels.tiled_lt check-nccl.n2 small small_unpadded \
  small_full small_tiled small_lt small_lt_tuned small_new small_big eager graph engine_eager \
  engine_graph w16_cast w16_copy; do
  [ -s "$work/logs/$name.log" ] || fail "case A: no log $name.log in DT_GPU_LOGS"
done
grep -q "^bench_gpu: small_tiled (DT_CUDA_FLASH=tiled .*1200 tok/s" "$work/err" ||
  fail "case A: the tiled run's figure was not said on stderr as it came"
echo "case A: every figure comes from its runs ($runs dt_train runs)"

# Case B.
cp "$work/results.md" "$work/before.md"
rc=0
STUB_KERNELS_FAIL=1 DT_GPU_RESULTS=$work/results.md "$root/perf/bench_gpu.sh" 30 \
  >"$work/out" 2>"$work/err" || rc=$?
[ "$rc" = 1 ] || { cat "$work/err" >&2; fail "case B: exit $rc with the kernel test failing, expected 1"; }
grep -q "cuda_kernels: FAILED" "$work/err" || fail "case B: no line naming the failed kernel test"
grep -q "$work/results.md left as it was" "$work/err" || fail "case B: no line saying the results were left"
cmp -s "$work/before.md" "$work/results.md" || fail "case B: DT_GPU_RESULTS changed"
echo "case B: a failed kernel test leaves the results file as it was, exit 1"

# Case C.
: >"$work/results.md"
rc=0
STUB_UNPADDED_SILENT=1 DT_GPU_RESULTS=$work/results.md "$root/perf/bench_gpu.sh" 30 \
  >"$work/out" 2>"$work/err" || rc=$?
[ "$rc" = 0 ] || { cat "$work/err" >&2; fail "case C: exit $rc, expected 0"; }
grep -q "small_unpadded: no 'dt_train: done:' line" "$work/err" ||
  fail "case C: no line naming the run without its done line"
expect "gpt-small: the head over the vocabulary" "not measured"
expect "padded head speed-up" "?"
expect "flash attention speed-up" "2.00x, tiled 2.40x"
echo "case C: a run without its done line is not measured, and the others are"
echo "bench_script: all passed"
