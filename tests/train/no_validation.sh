#!/usr/bin/env bash
# train.no_validation_split: with --data.val-fraction=0 nothing is evaluated: no validation loss is
# printed or logged, the summary says so, and every line of the step log is JSON.
#   no_validation.sh DT_TRAIN ARGS...
set -u
log=$(mktemp)
trap 'rm -f "$log"' EXIT
out=$("$@" --train.log-file="$log") || { echo "FAIL: dt_train exited with $?"; exit 1; }
if grep -qi "val loss\|val nan" <<<"$out"; then
  echo "FAIL: a validation loss was printed: $(grep -i 'val' <<<"$out" | head -n 2)"
  exit 1
fi
grep -q "train loss [0-9.]*, no validation split$" <<<"$out" ||
  { echo "FAIL: the summary does not say that there is no validation split"; exit 1; }
python3 - "$log" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]  # nan is not JSON: this raises
bad = [r for r in rows if "val_loss" in r]
if bad:
    sys.exit("FAIL: val_loss logged: %s" % bad[0])
print("json ok: %d steps, no val_loss" % len(rows))
PY
