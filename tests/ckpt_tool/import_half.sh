#!/usr/bin/env bash
# import of F16 and BF16 tensors: each value becomes its exact float32 (computed by Python).
. "$(dirname "$0")/common.sh"
run "$DT_CKPT" export "$CKPT" --format safetensors --output "$WORK/f32.safetensors"
expect_rc 0 "export"
run "$PY" "$TOOLS/st_tool.py" to-half "$WORK/f32.safetensors" "$WORK/half.safetensors" "$WORK/expect"
expect_rc 0 "to-half"
expect_line "BF16, F16"
run "$DT_CKPT" import "$WORK/half.safetensors" --output "$WORK/imported" --heads 4 --step 7
expect_rc 0 "import"
[ -f "$WORK/imported/step-7.h5" ] || fail "step-7.h5 not written"
run "$PY" "$TOOLS/st_tool.py" match-expected "$WORK/imported/step-7.h5" "$WORK/expect" "$WORK/dump"
expect_rc 0 "exact conversion"
run "$DT_CKPT" inspect "$WORK/imported/step-7.h5"
expect_line "^  step = 7$"
expect_line "^    model.heads = 4$"
pass "import of 16-bit tensors"
