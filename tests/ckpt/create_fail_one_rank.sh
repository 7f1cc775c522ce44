#!/usr/bin/env bash
# ckpt.create_fail_one_rank: the file of a save cannot be created on one rank only (a test seam,
# DT_TEST_CKPT_CREATE_FAIL, as an I/O error on one node would do), while the others hold it open.
# Closing it is collective, so no rank can unwind alone: the job ends at once (exit code 3),
# saying why, instead of waiting forever. The previous checkpoint and latest stay as they were,
# and the next run resumes from it and trains exactly like an uninterrupted run.
source "$(dirname "$0")/lib.sh"

# One learning-rate schedule for all runs, whatever --train.steps says.
S=(--optim.decay-steps=6)

train U 2 --train.steps=6 "${S[@]}" --train.log-file=U.jsonl
expect_rc U 0

saved=("${MPIEXEC[@]}")
MPIEXEC=("${MPIEXEC[@]}" -x DT_TEST_CKPT_CREATE_FAIL=1:step-4.h5)
train F 2 --train.steps=6 "${S[@]}" --ckpt.every=2 --ckpt.dir=D
MPIEXEC=("${saved[@]}")
expect_rc F 3
expect_line F "rank 0: saving .*D/step-4\.h5\.partial failed on some ranks only; aborting the job"
expect_line F "saved .*D/step-2\.h5"
expect_no_line F "saved .*step-4\.h5"
expect_no_file D/step-4.h5
expect_latest D step-2.h5

resumes_like_uninterrupted 2 6 "${S[@]}" --ckpt.every=2
finish
