#!/usr/bin/env bash
# Packs what perf/bench_gpu.sh runs into one archive for a GPU machine that has the CUDA Toolkit
# (cudart, cuBLAS) and NCCL but none of dt's other dependencies and no package registry, such as
# the H200 machines that `run` lends (/work/.library/device/KINDS.md).
#
#   perf/gpu_payload.sh [ARCHIVE]      default: build-gpu-payload/dt-gpu.tar.xz
#
# 1. builds dt with DT_WITH_CUDA=ON (Release) in $DT_BUILD_DIR (default build-gpu/): dt_train,
#    the CUDA plugin, the NCCL communicator (libdt_nccl.so), the GPU tests and perf/bench_gpu_gemm;
# 2. stages them, stripped, under dt/ with every library they load that is not glibc's,
#    libstdc++'s or CUDA's, taken whole from its Debian package (Open MPI with orted, its
#    components and help files, PMIx, UCX, hwloc, HDF5, OpenBLAS, Boost, OpenSSL, ...) under
#    dt/root/ in Debian's own layout, and a training text;
# 3. checks the staged tree in a mount namespace where this machine's own copies of those
#    libraries, Open MPI's programs and files are hidden (DT_PAYLOAD_CHECK=0 skips this): the
#    CUDA plugin loads, the GPU tests run (or skip without a GPU), and dt_train trains and saves
#    a checkpoint on 2 MPI ranks;
# 4. writes the archive (xz), small enough to travel with the tree (64 MiB in all).
#
# On the GPU machine: DT_GPU_PAYLOAD=ARCHIVE perf/bench_gpu.sh  (it unpacks the archive and runs
# every program through dt/dtenv, which points Open MPI, PMIx, UCX and hwloc at dt/root and finds
# the machine's CUDA libraries, from the toolkit or from pip's nvidia-* wheels).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${DT_BUILD_DIR:-$root/build-gpu}
archive=${1:-$root/build-gpu-payload/dt-gpu.tar.xz}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stage=$work/dt
die() { echo "gpu_payload: $*" >&2; exit 1; }
source "$root/perf/gpu_lib.sh"

command -v dpkg-query >/dev/null || die "dpkg-query not found: the payload is taken from Debian packages"
dt_gpu_build "$build" "$work" || die "the build failed (above)"

# 2. Stage.
mkdir -p "$stage/bin" "$stage/plugins" "$stage/lib/dt/plugins" "$stage/share" "$stage/root"
cp "$build"/bin/* "$stage/bin/"
cp "$build/plugins/libdt_hal_cuda.so" "$stage/plugins/"
# The NCCL communicator where libdt looks for it (lib/dt/plugins next to libdt).
cp "$build/lib/dt/plugins/libdt_nccl.so" "$stage/lib/dt/plugins/"
cp /usr/share/common-licenses/GPL-3 "$stage/share/train.txt"

# Everything the programs load, by resolved path: dt's own libraries go to dt/lib, CUDA's stay
# behind (the GPU machine has its own, matching its driver), the rest come from their packages.
is_cuda() {  # is_cuda NAME PATH
  case $1 in libcuda.so*|libcudart.so*|libcublas*.so*|libnccl.so*|libnvidia-*) return 0 ;; esac
  case $2 in /usr/local/cuda*|*/nvidia/*) return 0 ;; *) return 1 ;; esac
}
base_pkgs=" libc6 libstdc++6 libgcc-s1 "
declare -A pkgs=()
for p in openmpi-bin openmpi-common libopenmpi3 libpmix2 libucx0 libhwloc15 libhwloc-plugins; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' && pkgs[$p]=1
done
# (ldd of the build's own files: their RUNPATH, $ORIGIN/../lib, finds libdt in the build tree)
for f in "$build"/bin/* "$build/plugins/libdt_hal_cuda.so" "$build/lib/dt/plugins/libdt_nccl.so"; do
  f=$(readlink -f "$f")
  ldd "$f" >"$work/ldd"
  if grep 'not found' "$work/ldd" >&2; then die "$f loads libraries this machine lacks (above)"; fi
  awk '/=> \//{print $1, $3}' "$work/ldd"
done | sort -u >"$work/libs"
while read -r name path; do
  real=$(readlink -f "$path")
  if [[ $path == "$build"/* ]]; then
    cp "$real" "$stage/lib/$name"
  elif is_cuda "$name" "$path"; then
    echo "$name" >>"$work/cuda-libs"
  else
    owner=$(dpkg-query -S "$path" 2>/dev/null || dpkg-query -S "$real" 2>/dev/null) ||
      die "$path ($name) belongs to no Debian package and is not CUDA's: cannot take it along"
    owner=${owner%%:*}
    [[ $base_pkgs == *" $owner "* ]] || pkgs[$owner]=1
  fi
done <"$work/libs"
for p in "${!pkgs[@]}"; do
  dpkg-query -L "$p" | while read -r f; do
    case $f in /usr/share/doc/*|/usr/share/man/*|/usr/share/lintian/*|/usr/share/locale/*|/usr/share/info/*|/usr/share/bug/*) continue ;; esac
    [ -L "$f" ] || [ -f "$f" ] || continue
    d=$(realpath "$(dirname "$f")")  # /lib -> /usr/lib on a merged /usr
    mkdir -p "$stage/root$d" && cp -a "$f" "$stage/root$d/"
  done
done
# Absolute links (Debian's /etc/alternatives, lib links) point into this machine: make them
# relative inside root/, or drop them when their target was not taken.
find "$stage/root" -type l | while read -r l; do
  t=$(readlink "$l")
  [[ $t == /* ]] || continue
  rm "$l"
  t=$(readlink -f "$t")
  if [ -e "$stage/root$t" ]; then
    ln -s "$(realpath --relative-to="$(dirname "$l")" "$stage/root$t")" "$l"
  fi
done
# Debian names mpirun and mpiexec through /etc/alternatives, which no package owns; OpenBLAS
# too, whose library folders dtenv names.
ln -sf orterun "$stage/root/usr/bin/mpirun"
ln -sf orterun "$stage/root/usr/bin/mpiexec"
strip --strip-unneeded "$stage"/bin/* "$stage"/plugins/* "$stage"/lib/*.so* \
  "$stage"/lib/dt/plugins/* 2>/dev/null || true
sort -u "$work/cuda-libs" >"$stage/cuda-libs" 2>/dev/null || : >"$stage/cuda-libs"

cat >"$stage/dtenv" <<'EOF'
#!/usr/bin/env bash
# dtenv CMD [ARGS...]: runs CMD with this payload's libraries, Open MPI, PMIx, UCX and hwloc, and
# the machine's CUDA libraries (cuda-libs names them), found in the CUDA Toolkit's folders, in
# pip's nvidia-* wheels, or wherever the dynamic linker already finds them.
set -euo pipefail
P=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R=$P/root
L=$R/usr/lib/x86_64-linux-gnu
path=$P/lib:$L:$L/openmpi/lib:$L/pmix2/lib:$L/openblas-pthread
cache=$(ldconfig -p 2>/dev/null || true)
while read -r lib; do
  [ -n "$lib" ] || continue
  [[ $cache == *[[:space:]]"$lib "* ]] && continue
  found=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
           /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/x86_64-linux/lib \
           /opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib \
           /usr/local/lib/python3*/dist-packages/nvidia/*/lib /usr/lib/python3/dist-packages/nvidia/*/lib \
           /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    if [ -e "$d/$lib" ]; then found=$d; break; fi
  done
  if [ -z "$found" ]; then  # the programs that need it will fail to load, naming it
    echo "dtenv: warning: $lib (CUDA's, needed by dt) not found on this machine" >&2
    continue
  fi
  case ":$path:" in *":$found:"*) ;; *) path=$path:$found ;; esac
done <"$P/cuda-libs"
export LD_LIBRARY_PATH=$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$P/bin:$R/usr/bin:$PATH
export OPAL_PREFIX=$R/usr
export OMPI_MCA_mca_base_param_files=$R/etc/openmpi/openmpi-mca-params.conf
# Components for fabrics the payload has no libraries for (netlink, PSM) are skipped quietly.
export OMPI_MCA_mca_base_component_show_load_errors=0
export PMIX_INSTALL_PREFIX=$L/pmix2
export PMIX_MCA_mca_base_component_path=$L/pmix2/lib/pmix
export UCX_MODULE_DIR=$L/ucx
export HWLOC_PLUGINS_PATH=$L/hwloc
export DT_PLUGIN_PATH=$P/plugins
exec "$@"
EOF
chmod +x "$stage/dtenv"

# 3. Check the staged tree with this machine's copies hidden.
if [ "${DT_PAYLOAD_CHECK:-1}" != 0 ]; then
  "$root/perf/gpu_payload_check.sh" "$stage" "$build" || die "the staged payload failed its check (above)"
fi

# 4. Pack.
mkdir -p "$(dirname "$archive")"
tar -C "$work" -cf - dt | xz -T0 -6 >"$archive.tmp"
mv "$archive.tmp" "$archive"
echo "gpu_payload: $archive: $(du -h "$archive" | cut -f1) ($(du -sh "$stage" | cut -f1) unpacked)"
