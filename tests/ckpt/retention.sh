#!/usr/bin/env bash
# ckpt.retention: --ckpt.keep=2 --ckpt.every=1 over 5 steps leaves exactly the 2 newest
# checkpoints (step-4.h5, step-5.h5), latest pointing to step-5.h5, and no temporary files.
source "$(dirname "$0")/lib.sh"

train K 2 --train.steps=5 --ckpt.every=1 --ckpt.keep=2 --ckpt.dir=D
expect_rc K 0
for k in 1 2 3 4 5; do expect_line K "saved .*D/step-$k\.h5"; done
[ "$(files_in D)" = "latest step-4.h5 step-5.h5" ] || fail "files left: $(files_in D)"
expect_latest D step-5.h5
# The newest resumes.
train V 1 --train.steps=5 --ckpt.dir=D --eval-only --eval.sequences=8
expect_rc V 0
expect_line V "resumed from .*D/step-5\.h5 at step 5 "
finish
