#!/usr/bin/env bash
# same_losses.sh -- CMD_A... -- CMD_B...: both dt_train runs must give identical per-step
# training and validation losses, and at least one: the step logs (--train.log-file, one JSON
# line a step with %.9g values, added to each command) must hold the same steps with equal loss,
# lr and val_loss (and loss_scale and skipped in mixed precision), checked by
# ../ckpt/steplog.py with a tolerance of 0; the console lines "step N/M | loss X ..." must be
# identical too (they also hold the validation loss before the first step).
# same_losses.sh --differ REGEX -- CMD_A... -- CMD_B...: both runs must succeed, their losses must
# differ, and the second run's output must match REGEX (the reason they differ).
# same_losses.sh --rtol R -- CMD_A... -- CMD_B...: the step logs must agree within R relative
# (loss, lr, val_loss; the same computation in another order of sums), the console lines are not
# compared.
# CMD_B may be wrapped in tests/expect.sh (expect.sh RC REGEX -- CMD...): the log option goes at
# the end of each command, which is always dt_train's own arguments.
set -u
differ=""
rtol=0
if [ "$1" = "--differ" ]; then differ=$2; shift 2; fi
if [ "$1" = "--rtol" ]; then rtol=$2; shift 2; fi
[ "$1" = "--" ] && shift
a=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do a+=("$1"); shift; done
shift
steplog="$(cd "$(dirname "$0")" && pwd)/../ckpt/steplog.py"
logs=$(mktemp -d) || exit 1
trap 'rm -rf "$logs"' EXIT
log_a=$logs/a.jsonl
log_b=$logs/b.jsonl
extract() { grep -oE '^step +[0-9/]+ \| (loss [0-9.]+)?( \| val [0-9.]+)?|val loss [0-9.]+' ; }
out_a=$("${a[@]}" --train.log-file="$log_a" 2>&1) ||
  { printf '%s\n' "$out_a"; echo "same_losses.sh: FAIL: first run"; exit 1; }
out_b=$("$@" --train.log-file="$log_b" 2>&1) ||
  { printf '%s\n' "$out_b"; echo "same_losses.sh: FAIL: second run"; exit 1; }
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
if [ "$rtol" = 0 ] && [ "$la" != "$lb" ]; then
  diff <(echo "$la") <(echo "$lb")
  echo "same_losses.sh: FAIL: losses differ"
  exit 1
fi
# The step range of the first log; the second must hold exactly the same steps.
for f in "$log_a" "$log_b"; do
  [ -s "$f" ] || { echo "same_losses.sh: FAIL: no step log $f"; exit 1; }
done
first=$(sed -n '1s/^{"step": \([0-9][0-9]*\),.*/\1/p' "$log_a")
last=$(sed -n '$s/^{"step": \([0-9][0-9]*\),.*/\1/p' "$log_a")
[ -n "$first" ] && [ -n "$last" ] ||
  { echo "same_losses.sh: FAIL: no step numbers in $log_a"; cat "$log_a"; exit 1; }
for f in "$log_a" "$log_b"; do
  python3 "$steplog" steps "$f" "$first" "$last" ||
    { echo "same_losses.sh: FAIL: step log $f"; cat "$f"; exit 1; }
done
python3 "$steplog" same "$log_a" "$log_b" "$first" "$last" "$rtol" ||
  { echo "same_losses.sh: FAIL: the step logs differ"; exit 1; }
if [ "$rtol" != 0 ]; then
  echo "same_losses.sh: PASS: steps $first..$last agree within $rtol relative in the step logs"
  exit 0
fi
echo "same_losses.sh: PASS: $(echo "$la" | wc -l) loss lines identical," \
  "steps $first..$last identical in the step logs"
