#!/usr/bin/env bash
# expect.sh RC REGEX -- CMD...
# Runs CMD; passes when it exits with RC ("nonzero": any non-zero code) and its combined
# output has a line matching the extended regex REGEX. Prints the output either way. CMD's exit
# code 77 (skipped), when RC is not 77, is passed on (for SKIP_RETURN_CODE 77).
set -u
want_rc=$1
regex=$2
shift 2
[ "${1:-}" = "--" ] && shift
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
echo "expect.sh: exit code $rc (wanted $want_rc)"
if [ "$want_rc" = nonzero ]; then
  [ "$rc" -ne 0 ] || { echo "expect.sh: FAIL: command succeeded"; exit 1; }
elif [ "$rc" -eq 77 ] && [ "$want_rc" != 77 ]; then
  echo "expect.sh: skipped"
  exit 77
elif [ "$rc" -ne "$want_rc" ]; then
  echo "expect.sh: FAIL: wrong exit code"
  exit 1
fi
if ! printf '%s\n' "$out" | grep -Eq -- "$regex"; then
  echo "expect.sh: FAIL: no line matches /$regex/"
  exit 1
fi
echo "expect.sh: PASS"
