#!/usr/bin/env bash
# final_val.sh MAX_RATIO CMD...: runs a dt_train command and passes when its final validation
# loss is at most MAX_RATIO times the initial one ("val loss A -> B" in the summary line).
set -u
ratio=$1
shift
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
[ $rc -eq 0 ] || { echo "final_val.sh: FAIL: exit code $rc"; exit 1; }
line=$(printf '%s\n' "$out" | grep -E 'val loss [0-9.]+ -> [0-9.]+' | tail -1)
[ -n "$line" ] || { echo "final_val.sh: FAIL: no summary line"; exit 1; }
a=$(sed -E 's/.*val loss ([0-9.]+) -> ([0-9.]+).*/\1/' <<<"$line")
b=$(sed -E 's/.*val loss ([0-9.]+) -> ([0-9.]+).*/\2/' <<<"$line")
if awk -v a="$a" -v b="$b" -v r="$ratio" 'BEGIN { exit !(b <= a * r) }'; then
  echo "final_val.sh: PASS: val loss $a -> $b (limit $(awk -v a="$a" -v r="$ratio" 'BEGIN{print a*r}'))"
else
  echo "final_val.sh: FAIL: val loss $a -> $b, above $ratio of the initial value"
  exit 1
fi
