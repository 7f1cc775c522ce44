#!/usr/bin/env bash
# ckpt.resume_reshard: a checkpoint written by 2 ranks resumes on 1, 2 and 4 ranks and continues
# the uninterrupted run exactly: the losses, learning rates and validation losses of the resumed
# steps equal those of a 2-rank run that never stopped (within 1e-5 relative).
source "$(dirname "$0")/lib.sh"

train A 2 --train.steps=12 --train.log-file=A.jsonl
expect_rc A 0
train B 2 --train.steps=12 --ckpt.dir=D --ckpt.every=6 --train.log-file=B.jsonl
expect_rc B 0
expect_file D/step-6.h5
expect_file D/step-12.h5
expect_latest D step-12.h5
# Saving does not disturb training.
steplog same A.jsonl B.jsonl 1 12 1e-6

for R in 1 2 4; do
  train R$R "$R" --train.steps=12 --ckpt.resume="$WORK/D/step-6.h5" --ckpt.dir=E$R \
    --train.log-file=R$R.jsonl
  expect_rc R$R 0
  expect_line R$R "resumed from .*D/step-6\.h5 at step 6 "
  expect_line R$R "written by dp=2"
  # Only the remaining steps run, and they continue run A (loss, lr schedule, final val_loss).
  steplog steps R$R.jsonl 7 12
  steplog same A.jsonl R$R.jsonl 7 12 1e-5
  expect_file E$R/step-12.h5
done
# The source checkpoints were only read.
[ "$(files_in D)" = "latest step-12.h5 step-6.h5" ] || fail "D changed: $(files_in D)"
finish
