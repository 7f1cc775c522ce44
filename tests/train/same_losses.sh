#!/usr/bin/env bash
# same_losses.sh -- CMD_A... -- CMD_B...: both dt_train runs must print identical per-step
# training and validation losses (the lines "step N/M | loss X ..."), and at least one.
set -u
[ "$1" = "--" ] && shift
a=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do a+=("$1"); shift; done
shift
extract() { grep -oE '^step +[0-9/]+ \| (loss [0-9.]+)?( \| val [0-9.]+)?|val loss [0-9.]+' ; }
out_a=$("${a[@]}" 2>&1) || { printf '%s\n' "$out_a"; echo "same_losses.sh: FAIL: first run"; exit 1; }
out_b=$("$@" 2>&1) || { printf '%s\n' "$out_b"; echo "same_losses.sh: FAIL: second run"; exit 1; }
la=$(printf '%s\n' "$out_a" | extract)
lb=$(printf '%s\n' "$out_b" | extract)
printf '%s\n--- second run ---\n%s\n' "$out_a" "$out_b"
[ -n "$la" ] || { echo "same_losses.sh: FAIL: no loss lines"; exit 1; }
if [ "$la" != "$lb" ]; then
  diff <(echo "$la") <(echo "$lb")
  echo "same_losses.sh: FAIL: losses differ"
  exit 1
fi
echo "same_losses.sh: PASS: $(echo "$la" | wc -l) loss lines identical"
