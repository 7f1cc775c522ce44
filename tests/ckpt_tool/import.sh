#!/usr/bin/env bash
# import of an exported file: a checkpoint that verifies, /model byte-identical to the original,
# zero optimiser moments, the import attributes; dt_train evaluates it to the original's loss
# and trains one step from it. A folder of encrypted checkpoints is refused without their key;
# with it the import is encrypted, verifies and evaluates with the key, and the folder's run
# resumes from it; another key, and a key for a folder of plain checkpoints, are refused.
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

loss() {  # loss CHECKPOINT [OPTION...]
  local ck=$1
  shift
  "$DT_TRAIN" --config "$CONFIG" --data.path="$TEXT" --model.heads=2 --eval-only \
    --eval.sequences=8 --ckpt.resume="$ck" "$@" 2>&1 |
    sed -nE 's/.*eval-only: .* loss ([0-9.]+)$/\1/p'
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

# With another key, and with a key into a folder of plain checkpoints: refused, nothing written.
head -c 32 /dev/urandom >"$WORK/other.key" && chmod 600 "$WORK/other.key" || fail "key file"
run "$DT_CKPT" import "$st" --output "$WORK/enc" --heads 2 --step 3 \
  --security.key_file "$WORK/other.key"
expect_rc 2 "import with another key than the folder's"
expect_line "option --output: $WORK/enc holds checkpoints of another key \(checkpoint key: wrong key for $WORK/enc/step-2\.h5"
[ "$(ls "$WORK/enc")" = "$before" ] || fail "the refused import changed $WORK/enc: $(ls "$WORK/enc")"
plain_before=$(ls "$WORK/imported")
run "$DT_CKPT" import "$st" --output "$WORK/imported" --heads 2 --step 3 \
  --security.key_file "$WORK/job.key"
expect_rc 2 "an encrypted import into a folder of plain checkpoints"
expect_line "option --output: $WORK/imported holds plain checkpoints \($WORK/imported/step-0\.h5\)"
[ "$(ls "$WORK/imported")" = "$plain_before" ] || fail "the refused import changed $WORK/imported"

# With the folder's key: an encrypted checkpoint the folder's run resumes from.
run "$DT_CKPT" import "$st" --output "$WORK/enc" --heads 2 --step 3 \
  --security.key_file "$WORK/job.key"
expect_rc 0 "an encrypted import with the folder's key"
eimp=$WORK/enc/step-3.h5
expect_line "^imported 28 tensors .* into $eimp \(encrypted\)$"
expect_line "^resume with: dt_train .* --ckpt.resume=$eimp --ckpt.encrypt=true --security.key_file=$WORK/job.key \.\.\.$"
run "$DT_CKPT" inspect "$eimp"
printf '%s\n' "$OUT" | grep -qxF "  encryption = aes-256-gcm" || fail "the import is not encrypted"
run "$DT_CKPT" verify "$eimp" --security.key_file "$WORK/job.key"
expect_rc 0 "the encrypted import verifies and authenticates with the key"
run "$DT_CKPT" verify "$eimp" --security.key_file "$WORK/other.key"
expect_rc 1 "another key: the verification fails"
expect_line "wrong key"
c=$(loss "$eimp" --ckpt.encrypt=true --security.key_file="$WORK/job.key")
echo "eval loss: original $a, encrypted import $c"
[ "$c" = "$a" ] || fail "the encrypted import does not evaluate like the original"
run "$DT_TRAIN" --config "$CONFIG" --data.path="$TEXT" --model.heads=2 --train.steps=4 \
  --ckpt.dir="$WORK/enc" --ckpt.encrypt=true --security.key_file="$WORK/job.key"
expect_rc 0 "the folder's run from the encrypted import"
expect_line "ckpt: resumed from $eimp at step 3"
expect_line "^step +4/4 \| loss [0-9.]+"
pass "import"
