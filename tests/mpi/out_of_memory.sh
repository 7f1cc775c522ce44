#!/usr/bin/env bash
# A size within an option's range that memory cannot hold: the tool says so and which option to
# lower, and ends with exit 3 (MPI_Abort), not SIGABRT from an uncaught std::bad_alloc.
#   out_of_memory.sh SANITIZE LIMIT_KB WANT_REGEX PROGRAM SMALL_ARGS... -- BIG_ARGS...
# Runs PROGRAM BIG_ARGS under ulimit -v LIMIT_KB. First PROGRAM SMALL_ARGS (sizes that fit) must
# succeed under the same limit; where it does not, MPI itself cannot start under it here (some
# transports map large regions at start-up) and the test is skipped (77). Skipped too for a
# sanitizer build (SANITIZE ON), whose shadow memory needs more address space than any such limit.
set -u
sanitize=$1 limit=$2 want=$3 program=$4
shift 4
small=() big=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do small+=("$1"); shift; done
shift
big=("$@")
tool=$(basename "$program")
if [ "$sanitize" = ON ] || ldd "$program" 2>/dev/null | grep -q 'libasan'; then
  echo "SKIP: $tool is built with AddressSanitizer (ulimit -v cannot apply)"
  exit 77
fi
if ! control=$( (ulimit -v "$limit" && exec "$program" "${small[@]}") 2>&1); then
  echo "$control" | tail -5
  echo "SKIP: $tool ${small[*]} fails under ulimit -v $limit: MPI needs more here"
  exit 77
fi
out=$( (ulimit -v "$limit" && exec "$program" "${big[@]}") 2>&1)
rc=$?
echo "$out" | grep -v '^ \|^--\|^$'
[ $rc -eq 3 ] || { echo "FAIL: exit code $rc, expected 3"; exit 1; }
echo "$out" | grep -qE "$want" || { echo "FAIL: no line matches /$want/"; exit 1; }
echo "out_of_memory.sh: PASS"
