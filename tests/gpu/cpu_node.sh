#!/usr/bin/env bash
# gpu.cpu_node: one CUDA build of dt serves a cluster's CPU-only nodes too. In a mount namespace
# whose CUDA library folders are empty (a node without the CUDA Toolkit or NCCL), dt_train trains
# on the CPU device on 2 ranks; a run on the cuda device is refused (exit 2) naming the plugin and
# the library it lacks; and the NCCL communicator is refused naming NCCL (dt_nccl_module_test).
#   cpu_node.sh MPIEXEC DT_TRAIN MODULE_TEST NCCL_MODULE TEXT CUDA_LIBRARY...
#   (CUDA_LIBRARY: libraries of the toolkit and NCCL; the folders holding them are hidden)
# Needs root (unshare -m); exits 77 with one line where it cannot make the namespace.
set -u
if [ "${DT_CPU_NODE_NS:-}" != inside ]; then
  [ $# -ge 6 ] || { echo "usage: $0 MPIEXEC DT_TRAIN MODULE_TEST NCCL_MODULE TEXT CUDA_LIBRARY..." >&2; exit 2; }
  if [ "$(id -u)" != 0 ] || ! unshare -m true 2>/dev/null; then
    echo "SKIP gpu.cpu_node: needs root and unshare -m (a mount namespace)"
    exit 77
  fi
  exec env DT_CPU_NODE_NS=inside unshare -m --propagation private "$0" "$@"
fi
MPIEXEC=$1 TRAIN=$2 MODULE_TEST=$3 NCCL_MODULE=$4 TEXT=$5
shift 5
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
empty=$(mktemp -d)
trap 'rm -rf "$empty"' EXIT
declare -A dirs=()
for lib in "$@"; do
  real=$(readlink -f "$lib") || continue
  dirs[$(dirname "$real")]=1
done
for d in "${!dirs[@]}"; do
  # Libraries installed among the system's own (a distribution's CUDA or NCCL packages) cannot be
  # hidden by their folder without hiding the C library too.
  if [ -e "$d/libc.so.6" ]; then
    echo "SKIP gpu.cpu_node: the CUDA libraries are in $d, with the C library"
    exit 77
  fi
done
for d in "${!dirs[@]}"; do
  mount --bind "$empty" "$d" || { echo "FAIL: cannot hide $d"; exit 1; }
  echo "hidden: $d"
done
# The namespace must really lack NCCL, or the rest proves nothing.
if out=$(ldd "$NCCL_MODULE" 2>&1) &&
   ! echo "$out" | grep -q "libnccl.so.* => not found"; then
  echo "$out"
  fail "libnccl is still found in the namespace"
fi

echo "=== dt_train on the CPU device, 2 ranks"
out=$("$MPIEXEC" -n 2 "$TRAIN" --config "$(dirname "$0")/../../configs/micro.ini" \
      --data.path="$TEXT" --train.steps=3 --train.eval-every=0 --train.log-every=1 2>&1)
rc=$?
echo "$out" | tail -5
[ $rc -eq 0 ] || fail "dt_train on the CPU device exited $rc"
echo "$out" | grep -q "step *3" || fail "dt_train printed no step 3"

echo "=== dt_train on the cuda device"
out=$("$TRAIN" --config "$(dirname "$0")/../../configs/micro.ini" --data.path="$TEXT" \
      --runtime.device=cuda --train.steps=1 2>&1)
rc=$?
echo "$out" | tail -3
[ $rc -eq 2 ] || fail "dt_train on the cuda device exited $rc, expected 2 (a clear refusal)"
echo "$out" | grep -q "device 'cuda': no copy of libdt_hal_cuda.so in the plugin path .* could be loaded: .*libcublas" ||
  fail "the refusal does not name the plugin and the missing cuBLAS"

echo "=== the NCCL communicator"
DT_TEST_NCCL_HIDDEN=1 "$MODULE_TEST" || fail "dt_nccl_module_test without NCCL"

[ $FAILED -eq 0 ] && { echo "cpu_node.sh: PASS"; exit 0; }
echo "cpu_node.sh: FAIL"
exit 1
