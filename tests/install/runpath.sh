#!/usr/bin/env bash
# install.runpath: the programs, libdt and the device plugins dt installs carry a RUNPATH whose
# every entry is an absolute folder or one relative to the file ($ORIGIN), in the build tree and
# once installed; an empty entry would make the dynamic loader search the working directory. The
# installed dt_train and dt_topo load every library they need from their own prefix and the
# system's folders, as does the NCCL communicator (lib/dt/plugins/libdt_nccl.so) where CUDA is
# built; no program nor libdt needs a CUDA or NCCL library (only the plugins do). The default
# plugin path of the installed dt_train names each folder once.
#   runpath.sh WORKDIR BUILD_DIR FILE...   (FILE: the build tree's copies of what is installed)
set -u
[ $# -ge 3 ] || { echo "usage: $0 WORKDIR BUILD_DIR FILE..." >&2; exit 2; }
WORK=$1 BUILD=$2
shift 2
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
# check FILE: every RUNPATH/RPATH entry of FILE is absolute or starts with $ORIGIN.
check() {
  local f=$1 path entry
  path=$(readelf -d "$f" | sed -n 's/.*(\(RUNPATH\|RPATH\)).*\[\(.*\)\]$/\2/p')
  echo "  $f: [${path}]"
  # An empty path as a whole, or any empty entry (a leading, trailing or doubled colon).
  [ -z "$path" ] && return 0
  [[ $path == :* || $path == *: || $path == *::* ]] && { fail "$f: an empty RUNPATH entry"; return; }
  local IFS=:
  for entry in $path; do
    case $entry in /* | '$ORIGIN' | '$ORIGIN/'*) ;; *) fail "$f: RUNPATH entry '$entry' is relative" ;; esac
  done
}
rm -rf "$WORK"
mkdir -p "$WORK"
trap '[ -n "${DT_KEEP_TEST_DIR:-}" ] || rm -rf "$WORK"' EXIT
echo "=== build tree"
for f in "$@"; do
  [ -f "$f" ] || { fail "$f does not exist"; continue; }
  check "$f"
done
P=$WORK/prefix
echo "=== cmake --install $BUILD --prefix $P"
cmake --install "$BUILD" --prefix "$P" >"$WORK/install.out" 2>&1 ||
  { cat "$WORK/install.out"; fail "cmake --install failed"; }
n=0
for f in "$P"/bin/* "$P"/lib/*.so* "$P"/lib/dt/plugins/*.so "$P"/lib/dt/slurm/*.so; do
  [ -f "$f" ] && [ ! -L "$f" ] || continue
  check "$f"
  n=$((n + 1))
done
[ "$n" -ge "$#" ] || fail "$n files installed, fewer than the $# built"
# The installed programs resolve every library, libdt from the prefix, from another folder.
cd "$WORK" || exit 1
for prog in dt_train dt_topo; do
  out=$(ldd "$P/bin/$prog" 2>&1)
  echo "$out" | grep -q "not found" && fail "$prog: $(echo "$out" | grep 'not found')"
  lib=$(echo "$out" | awk '$1 == "libdt.so.0" { print $3 }')
  [ -n "$lib" ] && [ "$(realpath "$lib")" = "$(realpath "$P/lib/libdt.so.0")" ] ||
    fail "$prog loads libdt from '$lib', not from $P/lib"
done
if [ -f "$P/lib/dt/plugins/libdt_nccl.so" ]; then
  out=$(ldd "$P/lib/dt/plugins/libdt_nccl.so" 2>&1)
  echo "$out" | grep -q "not found" && fail "libdt_nccl.so: $(echo "$out" | grep 'not found')"
  lib=$(echo "$out" | awk '$1 == "libdt.so.0" { print $3 }')
  [ -n "$lib" ] && [ "$(realpath "$lib")" = "$(realpath "$P/lib/libdt.so.0")" ] ||
    fail "libdt_nccl.so loads libdt from '$lib', not from $P/lib"
fi
for f in "$P"/bin/* "$P"/lib/libdt.so*; do
  [ -f "$f" ] && [ ! -L "$f" ] || continue
  needed=$(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]$/\1/p' |
           grep -E '^lib(cuda|cudart|cublas|cublasLt|nccl)\.so' | tr '\n' ' ')
  [ -z "$needed" ] || fail "$f needs ${needed}(a node without CUDA could not start it)"
done
"$P/bin/dt_train" --version || fail "the installed dt_train does not start"
# The default plugin path names each folder once (lib/dt/plugins is next to the program and next
# to libdt, and the dt module names it in DT_PLUGIN_PATH).
for env_path in "" "$P/lib/dt/plugins"; do
  out=$(env -u DT_PLUGIN_PATH ${env_path:+DT_PLUGIN_PATH=$env_path} "$P/bin/dt_train" \
        --data.path=/usr/share/common-licenses/GPL-3 --runtime.device=nosuch 2>&1)
  echo "DT_PLUGIN_PATH='$env_path': $(echo "$out" | head -1)"
  path=$(echo "$out" | sed -n "s/.*not found in the plugin path '\(.*\)'.*/\1/p")
  [ -n "$path" ] || fail "no plugin path in: $out"
  dups=$(echo "$path" | tr ':' '\n' | xargs -r -n1 realpath -m | sort | uniq -d)
  [ -z "$dups" ] || fail "the default plugin path '$path' names $dups more than once"
done
[ $FAILED -eq 0 ] && { echo "runpath.sh: PASS"; exit 0; }
echo "runpath.sh: FAIL"
exit 1
