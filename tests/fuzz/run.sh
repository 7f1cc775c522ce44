#!/usr/bin/env bash
# Builds and runs dt's fuzz targets for a bounded time.
#   tests/fuzz/run.sh build DT_BUILD FUZZ_BUILD   configure + build every target (clang) against
#                                                 DT_BUILD/libdt.a (a release build of dt)
#   tests/fuzz/run.sh run FUZZ_BUILD TARGET SECS  replay TARGET's regression inputs, then fuzz it
#                                                 for SECS seconds from its committed seed corpus
# A crash leaves FUZZ_BUILD/artifacts/TARGET-crash-*; keep it as a regression test by copying it
# into tests/fuzz/regressions/TARGET/ (replayed by every run, and by ctest's fuzz.replay.* tests in
# both CI builds). New corpus entries go to FUZZ_BUILD/corpus/TARGET, never into the source tree.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
cmd=${1:-}
case "$cmd" in
  build)
    dt_build=$2 out=$3
    command -v clang++ >/dev/null ||
      { echo "fuzz: clang++ not found (Debian packages clang libclang-rt-14-dev; scripts/bootstrap)"; exit 1; }
    cmake -S "$here" -B "$out" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang \
      -DDT_SOURCE_DIR="$src" -DDT_LIB="$dt_build/libdt.a" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
    cmake --build "$out" -j "$(nproc)"
    ;;
  run)
    out=$2 target=$3 secs=$4
    bin=$out/$target
    [ -x "$bin" ] || { echo "fuzz: $bin is not built (run.sh build first)"; exit 1; }
    mkdir -p "$out/corpus/$target" "$out/artifacts"
    dict=()
    [ -f "$here/$target.dict" ] && dict=(-dict="$here/$target.dict")
    # MPI, PMIx and HDF5 keep process-lifetime allocations that LeakSanitizer would report.
    if [ "$target" = fuzz_ckpt ]; then
      dict+=(-detect_leaks=0)
      export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0
    fi
    regs=("$here/regressions/$target"/*)
    if [ -e "${regs[0]}" ]; then
      echo "fuzz: $target: replaying ${#regs[@]} regression inputs"
      "$bin" -runs=1 "${regs[@]}" 2>&1 | tail -n 3 ||
        { echo "fuzz: $target FAILED on a regression input (tests/fuzz/regressions/$target)"; exit 1; }
    fi
    set +e
    "$bin" -max_total_time="$secs" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="$out/artifacts/$target-" "${dict[@]}" \
      "$out/corpus/$target" "$here/corpus/$target" 2>&1 | grep -v "^#[0-9]" | tail -n 40
    rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" -ne 0 ]; then
      echo "fuzz: $target FAILED (exit $rc); the input is in $out/artifacts/"
      exit 1
    fi
    echo "fuzz: $target: no crash in $secs s"
    ;;
  *)
    sed -n '2,10p' "$0"
    exit 2
    ;;
esac
