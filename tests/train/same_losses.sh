#!/usr/bin/env bash
# same_losses.sh -- CMD_A... -- CMD_B...: both dt_train runs must print identical per-step
# training and validation losses (the lines "step N/M | loss X ..."), and at least one.
# same_losses.sh --differ REGEX -- CMD_A... -- CMD_B...: both runs must succeed, their losses must
# differ, and the second run's output must match REGEX (the reason they differ).
set -u
differ=""
if [ "$1" = "--differ" ]; then differ=$2; shift 2; fi
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
if [ -n "$differ" ]; then
  printf '%s\n' "$out_b" | grep -qE -- "$differ" ||
    { echo "same_losses.sh: FAIL: the second run does not say '$differ'"; exit 1; }
  [ "$la" != "$lb" ] || { echo "same_losses.sh: FAIL: the losses are the same"; exit 1; }
  echo "same_losses.sh: PASS: the losses differ; the second run says '$differ'"
  exit 0
fi
if [ "$la" != "$lb" ]; then
  diff <(echo "$la") <(echo "$lb")
  echo "same_losses.sh: FAIL: losses differ"
  exit 1
fi
echo "same_losses.sh: PASS: $(echo "$la" | wc -l) loss lines identical"
