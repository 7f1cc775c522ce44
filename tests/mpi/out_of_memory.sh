#!/usr/bin/env bash
# A size within an option's range that memory cannot hold: the tool says so and which option to
# lower, and ends with exit 3 (MPI_Abort), not SIGABRT from an uncaught std::bad_alloc.
#   out_of_memory.sh LIMIT_KB WANT_REGEX PROGRAM ARGS...   (runs PROGRAM under ulimit -v LIMIT_KB)
# Skipped (77) for a sanitizer build, whose shadow memory needs more address space than any limit.
set -u
limit=$1 want=$2
shift 2
if ldd "$1" 2>/dev/null | grep -q 'libasan'; then
  echo "SKIP: $1 is built with AddressSanitizer (ulimit -v cannot apply)"
  exit 77
fi
out=$( (ulimit -v "$limit" && exec "$@") 2>&1)
rc=$?
echo "$out" | grep -v '^ \|^--\|^$'
[ $rc -eq 3 ] || { echo "FAIL: exit code $rc, expected 3"; exit 1; }
echo "$out" | grep -qE "$want" || { echo "FAIL: no line matches /$want/"; exit 1; }
echo "out_of_memory.sh: PASS"
