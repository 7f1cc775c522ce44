#!/usr/bin/env bash
# export: a safetensors file that Python's json + struct read back, every tensor equal to the
# HDF5 data (h5dump -b LE), lm_head.weight = transformer.wte.weight; an OUT that exists and is
# not a safetensors file is refused, one that is is replaced; a corrupt checkpoint is
# refused (exit 1) and nothing is written, and so is a truncated one; a config that is not UTF-8
# exports.
. "$(dirname "$0")/common.sh"
out=$WORK/model.safetensors
run "$DT_CKPT" export "$CKPT" --format safetensors --output "$out"
expect_rc 0 "export"
expect_line "^exported 29 tensors"
[ -f "$out" ] || fail "$out missing"
leftovers() { compgen -G "$1.tmp*" && fail "a temporary file of $1 was left behind"; }
leftovers "$out"
run "$PY" "$TOOLS/st_tool.py" check-export "$out" "$CKPT" 4 "$WORK/dump"
expect_rc 0 "independent check of the safetensors file"

# An existing OUT that is not a safetensors file (a checkpoint, any other file, a directory) is
# refused and left as it is; a safetensors file (the export above) is replaced, and a file of the
# user's named like a temporary file is not touched on the way.
mkdir -p "$WORK/E" && cp "$CKPTS/step-2.h5" "$WORK/E/step-3.h5" && printf 'notes\n' >"$WORK/notes" &&
  mkdir -p "$WORK/dir.safetensors" || fail "set-up"
sum=$(cat "$WORK/E/step-3.h5" "$WORK/notes" | sha256sum)
run "$DT_CKPT" export "$CKPT" --format safetensors --output "$WORK/E/step-3.h5"
expect_rc 2 "export over a checkpoint"
expect_line "option --output: $WORK/E/step-3\.h5 exists and is not a safetensors file \(no safetensors header length\); nothing was written"
run "$DT_CKPT" export "$CKPT" --format safetensors --output "$WORK/notes"
expect_rc 2 "export over a text file"
expect_line "option --output: $WORK/notes exists and is not a safetensors file \(shorter than the 8-byte header length\)"
run "$DT_CKPT" export "$CKPT" --format safetensors --output "$WORK/dir.safetensors"
expect_rc 2 "export over a directory"
expect_line "option --output: $WORK/dir\.safetensors is a directory"
[ "$(cat "$WORK/E/step-3.h5" "$WORK/notes" | sha256sum)" = "$sum" ] || fail "a refused OUT was changed"
[ -z "$(ls -A "$WORK/dir.safetensors")" ] || fail "something was written into the directory"
leftovers "$WORK/E/step-3.h5"
leftovers "$WORK/notes"
printf 'mine\n' >"$out.tmp"
run "$DT_CKPT" export "$CKPTS/step-2.h5" --format safetensors --output "$out"
expect_rc 0 "export over an earlier export"
expect_line "^exported 29 tensors .* to $out \(replacing the safetensors file there\)$"
[ "$(cat "$out.tmp")" = mine ] || fail "$out.tmp, a file of the user's, was changed"
rm -f "$out.tmp"
leftovers "$out"
run "$PY" "$TOOLS/st_tool.py" check-export "$out" "$CKPTS/step-2.h5" 2 "$WORK/dump2"
expect_rc 0 "independent check of the replaced safetensors file"

cp "$CKPT" "$WORK/flipped.h5" || fail copy
flip "$WORK/flipped.h5" /model/transformer.h.1.mlp.c_fc.weight
run "$DT_CKPT" export "$WORK/flipped.h5" --format safetensors --output "$WORK/bad.safetensors"
expect_rc 1 "export of a corrupt checkpoint"
expect_line "refusing to export $WORK/flipped\.h5"
expect_line "^  /model/transformer\.h\.1\.mlp\.c_fc\.weight: checksum mismatch in chunk 0"
[ ! -e "$WORK/bad.safetensors" ] || fail "a file was written"
leftovers "$WORK/bad.safetensors"
head -c 5000 "$CKPT" >"$WORK/truncated.h5" || fail "truncate"
run "$DT_CKPT" export "$WORK/truncated.h5" --format safetensors --output "$WORK/trunc.safetensors"
expect_rc 1 "export of a truncated checkpoint (as verify answers for it)"
expect_line "refusing to export $WORK/truncated\.h5"
[ ! -e "$WORK/trunc.safetensors" ] || fail "a file was written for the truncated checkpoint"

# Attributes are bytes: a config holding a byte that is not UTF-8 still exports (as U+FFFD).
run "$DT_TRAIN" --config "$CONFIG" --data.path="$TEXT" --train.steps=1 --ckpt.dir="$WORK/latin1" \
  --ckpt.every=1 --sample.prompt="$(printf 'caf\351')"
expect_rc 0 "dt_train with a prompt that is not UTF-8"
run "$DT_CKPT" export "$WORK/latin1/step-1.h5" --format safetensors --output "$WORK/latin1.safetensors"
expect_rc 0 "export of a checkpoint whose config is not UTF-8"
"$PY" - "$WORK/latin1.safetensors" <<'PY' || fail "the metadata of the export does not hold the prompt as caf\ufffd"
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    meta = json.loads(f.read(n).decode("utf-8"))["__metadata__"]
assert "prompt = caf\ufffd" in meta["config"], meta["config"][:400]
PY
pass "export"
