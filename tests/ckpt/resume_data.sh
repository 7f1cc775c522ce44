#!/usr/bin/env bash
# ckpt.resume_data: a checkpoint records what the run trained on (format, token count, digest),
# and a resume compares that with its own data: a byte-identical copy at another path continues
# the run without a warning (and step for step), other data at the same path is named in the
# warning with both identities.
source "$(dirname "$0")/lib.sh"
DT_CKPT=$(dirname "$BIN")/dt_ckpt
cp "$TEXT" "$WORK/data.txt"
cp "$TEXT" "$WORK/copy.txt"
TEXT=$WORK/data.txt  # what train() passes as --data.path
train A 2 --train.steps=5 --train.log-every=1 --ckpt.dir=A \
  --ckpt.every=3 --train.log-file=A.jsonl
expect_rc A 0
expect_file A/step-3.h5
tokens=$(wc -c <"$WORK/data.txt")
"$DT_CKPT" inspect A/step-3.h5 | grep -Eqx "  data = bytes, $tokens tokens, digest [0-9a-f]{16}" ||
  fail "dt_ckpt inspect shows no data line 'bytes, $tokens tokens, digest ...'"

# The same bytes elsewhere: the run continues, unwarned.
TEXT=$WORK/copy.txt
train B 2 --train.steps=5 --train.log-every=1 \
  --ckpt.resume="$WORK/A/step-3.h5" --train.log-file=B.jsonl
expect_rc B 0
expect_line B "resumed from .*A/step-3\.h5 at step 3 "
expect_no_line B "settings differ"
steplog same A.jsonl B.jsonl 4 5 0

# Other bytes at the same path (one byte changed in the first block): named in the warning.
printf 'Z' | dd of="$WORK/data.txt" bs=1 seek=100 conv=notrunc status=none
TEXT=$WORK/data.txt
train C 2 --train.steps=5 --train.log-every=1 \
  --ckpt.resume="$WORK/A/step-3.h5"
expect_rc C 0
expect_line C "ckpt: warning: settings differ from the checkpoint's \(data bytes, $tokens tokens, digest [0-9a-f]{16} -> bytes, $tokens tokens, digest [0-9a-f]{16}\): the run does not continue it exactly"
finish
