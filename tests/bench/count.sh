#!/usr/bin/env bash
# count.sh RC N REGEX -- CMD...
# Runs CMD; passes when it exits with RC and the extended regex REGEX matches exactly N times in
# its combined output (every match counts, also several on one line, as when the output of two
# ranks run together). Prints the output either way. A command that exits 77 (skipped) where RC is
# another code makes count.sh exit 77 too.
set -u
want_rc=$1 want_n=$2 regex=$3
shift 3
[ "${1:-}" = "--" ] && shift
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
if [ "$rc" -eq 77 ] && [ "$want_rc" -ne 77 ]; then
  echo "count.sh: the command skipped (exit code 77)"
  exit 77
fi
n=$(printf '%s\n' "$out" | grep -oE -- "$regex" | wc -l)
echo "count.sh: exit code $rc (wanted $want_rc), $n matches of /$regex/ (wanted $want_n)"
[ "$rc" -eq "$want_rc" ] || { echo "count.sh: FAIL: wrong exit code"; exit 1; }
[ "$n" -eq "$want_n" ] || { echo "count.sh: FAIL: wrong number of matches"; exit 1; }
echo "count.sh: PASS"
