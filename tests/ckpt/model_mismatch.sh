#!/usr/bin/env bash
# ckpt.model_mismatch: a micro checkpoint resumed with --model.embd=64 is refused before training
# (exit 2) with "checkpoint does not match the model", naming the setting with the file's and the
# run's values; with auto-resume it is not skipped (no silent fresh start), and the checkpoint
# directory is left as it was. The refusal comes before the model is planned and allocated (a
# model far over --mem.limit is refused for the checkpoint, not for its memory). Resumed with
# another --model.heads (the same shapes, another model), training and --eval-only are refused
# alike; other optimizer settings are named in a warning. (The load's own check, tensor by
# tensor, is tested in ckpt.pieces.refuse.)
source "$(dirname "$0")/lib.sh"

EMBD='checkpoint does not match the model: .*D/step-2\.h5 was trained with --model\.embd=32 \(this run: 64\)$'
train C 1 --train.steps=2 --ckpt.dir=D
expect_rc C 0
expect_file D/step-2.h5
before=$(files_in D)
sum=$(cksum <D/step-2.h5)

train M1 1 --train.steps=4 --ckpt.dir=D --model.embd=64
expect_rc M1 2
expect_line M1 "$EMBD"
expect_no_line M1 "starting from step 0|val loss"

train M2 2 --train.steps=4 --ckpt.resume="$WORK/D/step-2.h5" --ckpt.dir=E --model.embd=64
expect_rc M2 2
expect_line M2 "$EMBD"
expect_no_line M2 "val loss"
expect_no_file E/step-4.h5

# A model of 12 layers of 1024 (150M parameters): the checkpoint is refused before the plan.
train M3 2 --train.steps=4 --ckpt.dir=D --model.embd=1024 --model.layers=12 --mem.limit=16M
expect_rc M3 2
expect_line M3 "checkpoint does not match the model: .*D/step-2\.h5 was trained with --model\.layers=2 \(this run: 12\), --model\.embd=32 \(this run: 1024\)"
expect_no_line M3 "mem.limit"

# Another head count: every tensor has its shape, but the model is another one.
train H1 2 --train.steps=4 --ckpt.dir=D --model.heads=1
expect_rc H1 2
expect_line H1 "checkpoint does not match the model: .*D/step-2\.h5 was trained with --model\.heads=2 \(this run: 1\)$"
expect_no_line H1 "starting from step 0|val loss|^step "
train H2 1 --eval-only --ckpt.resume="$WORK/D/step-2.h5" --model.heads=4
expect_rc H2 2
expect_line H2 "checkpoint does not match the model: .*step-2\.h5 was trained with --model\.heads=2 \(this run: 4\)$"
expect_no_line H2 "eval-only: "

# The same model with other optimizer settings resumes, naming them (the update differs).
train O 1 --train.steps=3 --ckpt.resume="$WORK/D/step-2.h5" --ckpt.dir=O --optim.beta2=0.99 \
  --optim.weight-decay=0.05 --optim.grad-clip=0.5
expect_rc O 0
expect_line O "ckpt: warning: settings differ from the checkpoint's \(train.steps 2 -> 3, optim.decay-steps 2 -> 3, optim.beta2 0.95 -> 0.99, optim.weight-decay 0.1 -> 0.05, optim.grad-clip 1 -> 0.5\): the run does not continue it exactly"

[ "$(files_in D)" = "$before" ] || fail "D changed: $before -> $(files_in D)"
[ "$(cksum <D/step-2.h5)" = "$sum" ] || fail "D/step-2.h5 changed"
finish
