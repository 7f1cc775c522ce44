#!/usr/bin/env bash
# install.package: dt installed into a fresh prefix is a CMake package. A project of a user's own
# (tests/install/consumer) finds it with find_package(dt CONFIG REQUIRED), links dt::dt, and its
# program runs on 2 ranks: a dt::Runtime, an all_reduce, the built-in CPU device, the installed
# CPU plugin, a plugin in C++ that the project builds against dt::hal, and the installed template
# plugin (share/dt/hal) built in a C project against dt::hal. The package's exported interface
# names none of libdt's private dependencies.
#   package.sh WORKDIR BUILD_DIR CONSUMER_SRC CXX_COMPILER MPIEXEC [CXX_FLAGS]
set -u
[ $# -ge 5 ] || { echo "usage: $0 WORKDIR BUILD_DIR CONSUMER_SRC CXX_COMPILER MPIEXEC [CXX_FLAGS]" >&2; exit 2; }
WORK=$1 BUILD=$2 SRC=$3 CXX=$4 MPIEXEC=$5 FLAGS=${6:-}
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
finish() {
  [ $FAILED -eq 0 ] && { echo "package.sh: PASS"; exit 0; }
  echo "package.sh: FAIL"
  exit 1
}
rm -rf "$WORK"
mkdir -p "$WORK"
trap '[ -n "${DT_KEEP_TEST_DIR:-}" ] || rm -rf "$WORK"' EXIT
P=$WORK/prefix
echo "=== cmake --install $BUILD --prefix $P"
cmake --install "$BUILD" --prefix "$P" >"$WORK/install.out" 2>&1 ||
  { cat "$WORK/install.out"; fail "cmake --install failed"; finish; }
for f in dtConfig.cmake dtConfigVersion.cmake dtTargets.cmake; do
  [ -f "$P/lib/cmake/dt/$f" ] || fail "$P/lib/cmake/dt/$f is not installed"
done
# libdt is a shared library: what it links privately (Boost, hwloc, HDF5, OpenSSL, ...) and the
# project's own helper targets are not part of its interface. (CMake still names its private
# shared-library targets in IMPORTED_LINK_DEPENDENT_LIBRARIES, for -rpath-link only, and skips
# those a consumer does not have.)
leaks=$(grep -hE '^ *INTERFACE_' "$P"/lib/cmake/dt/dtTargets*.cmake |
  grep -oE 'PkgConfig::[A-Za-z_]+|Boost::[a-z_]+|OpenSSL::[A-Za-z]+|nlohmann_json[:A-Za-z_]*|dt_(warnings|httplib|ipsec_mb)|'"$BUILD"'[^ ";]*' |
  sort -u)
[ -z "$leaks" ] || fail "the exported targets name $(echo $leaks)"
echo "=== configure and build $SRC against $P"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if ! cmake -S "$SRC" -B "$WORK/consumer" "${generator[@]}" -DCMAKE_PREFIX_PATH="$P" \
  -DCMAKE_CXX_COMPILER="$CXX" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="$FLAGS" \
  -DCMAKE_EXE_LINKER_FLAGS="$FLAGS" -DCMAKE_MODULE_LINKER_FLAGS="$FLAGS" >"$WORK/configure.out" 2>&1; then
  cat "$WORK/configure.out"
  fail "find_package(dt CONFIG) against $P failed"
  finish
fi
grep -E "dt_DIR|MPI" "$WORK/configure.out"
if ! cmake --build "$WORK/consumer" >"$WORK/build.out" 2>&1; then
  cat "$WORK/build.out"
  fail "the consumer project does not build against $P"
  finish
fi
# The installed template, built in a C project against dt::hal alone (hal/README.md).
T=$P/share/dt/hal/template_device.c
[ -f "$T" ] && [ -f "$P/share/dt/hal/README.md" ] || fail "$P/share/dt/hal lacks the template or README.md"
if ! cmake -S "$SRC/npu" -B "$WORK/npu" "${generator[@]}" -DCMAKE_PREFIX_PATH="$P" \
  -DDT_TEMPLATE="$T" -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_MODULE_LINKER_FLAGS="$FLAGS" \
  >"$WORK/npu.out" 2>&1 || ! cmake --build "$WORK/npu" >>"$WORK/npu.out" 2>&1; then
  cat "$WORK/npu.out"
  fail "the installed template does not build against dt::hal"
fi
# It links libdt and MPI alone (the link line, as the linker may drop what is not used), loads libdt from the prefix (not from the build tree), and its
# plugin exports its entry.
if [ -f "$WORK/consumer/CMakeFiles/dt_consumer.dir/link.txt" ]; then
  link=$(cat "$WORK/consumer/CMakeFiles/dt_consumer.dir/link.txt")
else
  link=$(ninja -C "$WORK/consumer" -t commands dt_consumer | tail -n 1)
fi
echo "dt_consumer's link: $link"
echo "$link" | grep -q "$P/lib/libdt.so" || fail "dt_consumer is not linked with $P/lib/libdt.so"
private=$(echo "$link" | grep -oE 'boost|hwloc|hdf5|ssl|crypto|ucp|ucs|pmix|openblas|IPSec|httplib' | sort -u)
[ -z "$private" ] || fail "dt_consumer links libdt's private dependencies: $(echo $private)"
lib=$(ldd "$WORK/consumer/dt_consumer" | awk '$1 == "libdt.so.0" { print $3 }')
[ -n "$lib" ] && [ "$(realpath "$lib")" = "$(realpath "$P/lib/libdt.so.0")" ] ||
  fail "dt_consumer loads libdt from '$lib', not from $P/lib"
nm -D --defined-only "$WORK/consumer/libdt_hal_cxx.so" | grep -w dt_hal_plugin_v4 ||
  fail "libdt_hal_cxx.so does not export dt_hal_plugin_v4: $(nm -D --defined-only "$WORK/consumer/libdt_hal_cxx.so" | grep plugin)"
echo "=== mpiexec -n 2 dt_consumer"
cd "$WORK" || exit 1
out=$("$MPIEXEC" -n 2 "$WORK/consumer/dt_consumer" "$P/lib/dt/plugins" "$WORK/consumer:$WORK/npu" 2>&1)
rc=$?
echo "$out"
[ $rc -eq 0 ] || fail "dt_consumer exited with $rc"
for r in 0 1; do
  echo "$out" | grep -q "consumer: rank $r of 2: ok" || fail "rank $r did not pass"
done
finish
