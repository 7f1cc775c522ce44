#!/usr/bin/env bash
# ckpt.failed_save: a checkpoint save that fails on every rank before its commit (an I/O error;
# here test.fail-save-at-step) ends the job with exit code 3 and names the file and the reason.
# The previous checkpoint and latest stay as they were, and the next run resumes from it and
# trains exactly like an uninterrupted run.
source "$(dirname "$0")/lib.sh"

# One learning-rate schedule for all runs, whatever --train.steps says.
S=(--optim.decay-steps=6)

train U 2 --train.steps=6 "${S[@]}" --train.log-file=U.jsonl
expect_rc U 0

train F 2 --train.steps=6 "${S[@]}" --ckpt.every=2 --ckpt.dir=D --test.fail-save-at-step=4
expect_rc F 3
expect_line F "rank [0-9]+: saving .*D/step-4\.h5\.partial failed: test\.fail-save-at-step: the save of step 4"
expect_line F "saved .*D/step-2\.h5"
expect_no_line F "saved .*step-4\.h5"
expect_no_line F "^step +[56] "
expect_no_file D/step-4.h5
expect_latest D step-2.h5

resumes_like_uninterrupted 2 6 "${S[@]}" --ckpt.every=2
expect_line N "ignoring interrupted save .*D/step-4\.h5\.partial"
[ "$(files_in D)" = "latest step-2.h5 step-4.h5 step-6.h5" ] || fail "files at the end: $(files_in D)"
finish
