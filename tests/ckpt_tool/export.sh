#!/usr/bin/env bash
# export: a safetensors file that Python's json + struct read back, every tensor equal to the
# HDF5 data (h5dump -b LE), lm_head.weight = transformer.wte.weight; a corrupt checkpoint is
# refused (exit 1) and nothing is written.
. "$(dirname "$0")/common.sh"
out=$WORK/model.safetensors
run "$DT_CKPT" export "$CKPT" --format safetensors --output "$out"
expect_rc 0 "export"
expect_line "^exported 29 tensors"
[ -f "$out" ] && [ ! -e "$out.tmp" ] || fail "$out missing or $out.tmp left behind"
run "$PY" "$TOOLS/st_tool.py" check-export "$out" "$CKPT" 4 "$WORK/dump"
expect_rc 0 "independent check of the safetensors file"

cp "$CKPT" "$WORK/flipped.h5" || fail copy
flip "$WORK/flipped.h5" /model/transformer.h.1.mlp.c_fc.weight
run "$DT_CKPT" export "$WORK/flipped.h5" --format safetensors --output "$WORK/bad.safetensors"
expect_rc 1 "export of a corrupt checkpoint"
expect_line "refusing to export $WORK/flipped\.h5"
expect_line "^  /model/transformer\.h\.1\.mlp\.c_fc\.weight: checksum mismatch in chunk 0"
[ ! -e "$WORK/bad.safetensors" ] && [ ! -e "$WORK/bad.safetensors.tmp" ] || fail "a file was written"
pass "export"
