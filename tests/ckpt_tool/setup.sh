#!/usr/bin/env bash
# Fixture: two checkpoints (steps 2 and 4) of a 4-step micro run, written by dt_train.
. "$(dirname "$0")/common.sh"
rm -rf "$CKPTS"
run "$DT_TRAIN" --config "$CONFIG" --data.path="$TEXT" --train.steps=4 --ckpt.dir="$CKPTS" \
  --ckpt.every=2
expect_rc 0 "dt_train"
[ -f "$CKPTS/step-2.h5" ] && [ -f "$CKPTS/step-4.h5" ] || fail "step-2.h5 and step-4.h5 not both written"
[ "$(cat "$CKPTS/latest")" = step-4.h5 ] || fail "latest does not name step-4.h5"
pass "checkpoints in $CKPTS"
