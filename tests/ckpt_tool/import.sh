#!/usr/bin/env bash
# import of an exported file: a checkpoint that verifies, /model byte-identical to the original,
# zero optimiser moments, the import attributes; dt_train evaluates it to the original's loss
# and trains one step from it. A folder of encrypted checkpoints is refused.
. "$(dirname "$0")/common.sh"
st=$WORK/model.safetensors
run "$DT_CKPT" export "$CKPT" --format safetensors --output "$st"
expect_rc 0 "export"
run "$DT_CKPT" import "$st" --output "$WORK/imported" --heads 2
expect_rc 0 "import"
imp=$WORK/imported/step-0.h5
expect_line "^imported 28 tensors \(vocab 256, seq-len 32, layers 2, heads 2, embd 32\)"
[ "$(cat "$WORK/imported/latest")" = step-0.h5 ] || fail "latest does not name step-0.h5"
run "$DT_CKPT" verify "$imp"
expect_rc 0 "the imported checkpoint verifies"
run "$PY" "$TOOLS/st_tool.py" same-model "$CKPT" "$imp" "$WORK/dump"
expect_rc 0 "same /model data"
run "$DT_CKPT" inspect "$imp"
expect_rc 0 "inspect"
for line in "  step = 0" "  optimizer_step = 0" "  tokens = 0" "  layout = imported" "  config:" \
            "    model.vocab = 256" "    model.seq-len = 32" "    model.layers = 2" \
            "    model.heads = 2" "    model.embd = 32"; do
  printf '%s\n' "$OUT" | grep -qxF -- "$line" || fail "no line '$line'"
done
[ "$(printf '%s\n' "$OUT" | grep -c '^    ')" -eq 5 ] || fail "the config has other lines than the model's"
run "$DT_CKPT" import "$st" --output "$WORK/imported" --heads 2
expect_rc 2 "a second import into the same file"
expect_line "step-0\.h5 exists already"

loss() {
  "$DT_TRAIN" --config "$CONFIG" --data.path="$TEXT" --model.heads=2 --eval-only \
    --eval.sequences=8 --ckpt.resume="$1" 2>&1 | sed -nE 's/.*eval-only: .* loss ([0-9.]+)$/\1/p'
}
a=$(loss "$CKPT") b=$(loss "$imp")
echo "eval loss: original $a, imported $b"
[ -n "$a" ] && [ "$a" = "$b" ] || fail "the imported weights do not evaluate like the original's"
run "$DT_TRAIN" --config "$CONFIG" --data.path="$TEXT" --model.heads=2 --train.steps=1 \
  --ckpt.resume="$imp"
expect_rc 0 "dt_train from the imported checkpoint"
expect_line "ckpt: resumed from $imp at step 0"
expect_line "^step +1/1 \| loss [0-9.]+"

# A folder of encrypted checkpoints: refused (its run would refuse the plain import, and its
# newer encrypted checkpoints would be set aside), the folder left as it was.
head -c 32 /dev/urandom >"$WORK/job.key" && chmod 600 "$WORK/job.key" || fail "key file"
run "$DT_TRAIN" --config "$CONFIG" --data.path="$TEXT" --train.steps=2 --ckpt.dir="$WORK/enc" \
  --ckpt.encrypt=true --security.key_file="$WORK/job.key"
expect_rc 0 "an encrypted run"
before=$(ls "$WORK/enc")
run "$DT_CKPT" import "$st" --output "$WORK/enc" --heads 2 --step 1
expect_rc 2 "import into a folder of encrypted checkpoints"
expect_line "option --output: $WORK/enc holds encrypted checkpoints \($WORK/enc/step-2\.h5: aes-256-gcm\)"
[ "$(ls "$WORK/enc")" = "$before" ] || fail "the refused import changed $WORK/enc: $(ls "$WORK/enc")"
pass "import"
