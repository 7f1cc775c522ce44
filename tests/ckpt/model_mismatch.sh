#!/usr/bin/env bash
# ckpt.model_mismatch: a micro checkpoint resumed with --model.embd=64 is refused before training
# (exit 2) with "checkpoint does not match the model", naming transformer.wte.weight with the
# file's and the model's shapes; with auto-resume it is not skipped (no silent fresh start), and
# the checkpoint directory is left as it was. Resumed with another --model.heads (the same
# shapes, another model), training and --eval-only are refused alike.
source "$(dirname "$0")/lib.sh"

SHAPES='transformer\.wte\.weight.*(\[256, 32\].*\[256, 64\]|\[256, 64\].*\[256, 32\])'
train C 1 --train.steps=2 --ckpt.dir=D
expect_rc C 0
expect_file D/step-2.h5
before=$(files_in D)
sum=$(cksum <D/step-2.h5)

train M1 1 --train.steps=4 --ckpt.dir=D --model.embd=64
expect_rc M1 2
expect_line M1 "checkpoint does not match the model"
expect_line M1 "$SHAPES"
expect_no_line M1 "starting from step 0|val loss"

train M2 2 --train.steps=4 --ckpt.resume="$WORK/D/step-2.h5" --ckpt.dir=E --model.embd=64
expect_rc M2 2
expect_line M2 "checkpoint does not match the model"
expect_line M2 "$SHAPES"
expect_no_line M2 "val loss"
expect_no_file E/step-4.h5

# Another head count: every tensor has its shape, but the model is another one.
train H1 2 --train.steps=4 --ckpt.dir=D --model.heads=1
expect_rc H1 2
expect_line H1 "checkpoint does not match the model: .*D/step-2\.h5 was trained with --model\.heads=2, this run has --model\.heads=1"
expect_no_line H1 "starting from step 0|val loss|^step "
train H2 1 --eval-only --ckpt.resume="$WORK/D/step-2.h5" --model.heads=4
expect_rc H2 2
expect_line H2 "checkpoint does not match the model: .*step-2\.h5 was trained with --model\.heads=2, this run has --model\.heads=4"
expect_no_line H2 "eval-only: "

[ "$(files_in D)" = "$before" ] || fail "D changed: $before -> $(files_in D)"
[ "$(cksum <D/step-2.h5)" = "$sum" ] || fail "D/step-2.h5 changed"
finish
