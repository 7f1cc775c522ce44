#!/usr/bin/env bash
# perf/gpu_payload_check.sh STAGE [DIR...]: checks a payload staged by perf/gpu_payload.sh (STAGE
# is its dt/ folder) on this machine as a GPU machine would see it. In a mount namespace of its own it
# hides every library in /usr/lib/x86_64-linux-gnu but glibc's, libstdc++'s and the shell tools',
# Open MPI's programs, /etc/openmpi, the Open MPI, PMIx, UCX and hwloc data folders, and each DIR
# (the build the payload came from); then
#   - shows that dt_train no longer starts without the payload (the hiding works);
#   - runs through STAGE/dtenv the GPU checks of perf/gpu_lib.sh (the CUDA plugin's load test must
#     pass; the kernel test, on the default and the opt-in paths, and the NCCL test on 1 and 2
#     ranks pass, or skip without a GPU), and
#     dt_train on 2 MPI ranks for 20 steps with a checkpoint at step 10, then resumed from it for
#     10 more.
# Needs root (unshare -m). Exits non-zero, naming the step, on the first failure.
set -euo pipefail
stage=$(cd "${1:?usage: gpu_payload_check.sh STAGE}" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$stage/dtenv" ] || { echo "gpu_payload_check: $stage/dtenv missing: not a staged payload" >&2; exit 1; }

if [ "${DT_PAYLOAD_NS:-}" != inside ]; then
  [ "$(id -u)" = 0 ] || { echo "gpu_payload_check: needs root (a mount namespace)" >&2; exit 1; }
  # What stays in the library folder: glibc, libstdc++, libgcc, and what the tools used here load.
  keep=$(mktemp)  # removed inside, once read
  { dpkg-query -L libc6 libstdc++6 libgcc-s1 | grep -E '^(/usr)?/lib/x86_64-linux-gnu/[^/]*$' || true
    for t in bash env sed grep awk cat ls mkdir rm cp head mktemp dirname readlink timeout tail id \
             ldconfig mount xz tar; do
      ldd "$(command -v "$t")" 2>/dev/null | awk '/=> \//{print $3}'
    done; } | sort -u >"$keep"
  exec env DT_PAYLOAD_NS=inside DT_PAYLOAD_KEEP="$keep" unshare -m --propagation private \
    bash "$0" "$@"
fi
shift

lib=/usr/lib/x86_64-linux-gnu
shadow=$(mktemp -d)
mount -t tmpfs dt-payload-check "$shadow"
mkdir "$shadow/lib" "$shadow/empty"
while read -r f; do
  [ -e "$f" ] && cp -a "$f" "$shadow/lib/" && [ -L "$f" ] && cp -a "$(readlink -f "$f")" "$shadow/lib/"
done <"$DT_PAYLOAD_KEEP"
rm -f "$DT_PAYLOAD_KEEP"
for d in /etc/openmpi /usr/share/openmpi /usr/share/pmix /usr/share/hwloc /usr/share/ucx "$@"; do
  if [ -d "$d" ]; then mount --bind "$shadow/empty" "$d"; fi
done
for p in mpirun mpiexec orterun orted ompi_info; do
  if [ -e "/usr/bin/$p" ]; then mount --bind /dev/null "/usr/bin/$p"; fi
done
mount --bind "$shadow/lib" "$lib"  # last: mount itself needs what this hides

source "$root/perf/gpu_lib.sh"
fail() { echo "gpu_payload_check: FAIL: $*" >&2; exit 1; }
step() { echo "gpu_payload_check: $*"; }
run=$stage/dtenv
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# With only dt's own libraries, dt_train must miss MPI's: this machine's copy is hidden.
if LD_LIBRARY_PATH=$stage/lib "$stage/bin/dt_train" --help >"$out/bare" 2>&1 ||
   ! grep -q 'libmpi' "$out/bare"; then
  cat "$out/bare"
  fail "dt_train without the payload's libraries did not fail for want of MPI: the hiding did not work"
fi
step "without dtenv dt_train does not start, as it must: $(head -1 "$out/bare")"

dt_gpu_checks "$out" mpirun "$stage/bin" "$run"
[ -z "$DT_GPU_FAILED" ] || fail "the GPU checks failed:$DT_GPU_FAILED"
[[ " $DT_GPU_PASSED " == *" cuda_plugin_load "* ]] || fail "the CUDA plugin's load test did not pass"

train() {  # train LOG ARGS...
  local log=$1; shift
  timeout 300 "$run" mpirun -n 2 dt_train --config "$root/configs/micro.ini" \
    --data.path="$stage/share/train.txt" --ckpt.dir="$out/ckpt" "$@" >"$out/$log" 2>&1 ||
    { tail -30 "$out/$log"; fail "dt_train $* on 2 ranks"; }
  grep -E '^dt_train: done:' "$out/$log" | tail -1
}
step "trained: $(train first --train.steps=20 --ckpt.every=10)"
[ -e "$out/ckpt/step-10.h5" ] && [ -e "$out/ckpt/step-20.h5" ] ||
  fail "no checkpoints of steps 10 and 20 in $out/ckpt: $(ls "$out/ckpt")"
step "resumed: $(train resumed --train.steps=30 --ckpt.resume="$out/ckpt/step-20.h5")"
grep -q 'ckpt: resumed from' "$out/resumed" || { tail -30 "$out/resumed"; fail "the second run did not resume"; }
step "all passed"
