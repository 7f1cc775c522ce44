#!/usr/bin/env bash
# ckpt.failed_save: a checkpoint save that fails on every rank before its commit (an I/O error;
# here test.fail-save-at-step) ends the job with exit code 3 and names the file and the reason.
# The previous checkpoint and latest stay as they were, and the next run resumes from it and
# trains exactly like an uninterrupted run; also where the save fails at writing latest, after
# its file is complete (that file is removed again). A failure after the commit is a warning.
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

# A commit whose `latest` cannot be written (an I/O error, a file system out of inodes; here
# DT_TEST_CKPT_LATEST_FAIL) after step-4.h5 is complete: the new file is removed again, so that
# the folder is as it was (a complete step-4.h5 newer than `latest` was taken for another line of
# training by the next resume, and set aside), and the next run resumes from step 2 and trains on
# as the uninterrupted run.
MPIEXEC_PLAIN=("${MPIEXEC[@]}")
MPIEXEC=("${MPIEXEC[@]}" -x DT_TEST_CKPT_LATEST_FAIL=0:step-4.h5)
train L 2 --train.steps=6 "${S[@]}" --ckpt.every=2 --ckpt.dir=L
MPIEXEC=("${MPIEXEC_PLAIN[@]}")
expect_rc L 3
expect_line L "committing .*L/step-4\.h5 failed: cannot write .*L/latest: DT_TEST_CKPT_LATEST_FAIL.*L/step-4\.h5 removed [(]latest still names the previous checkpoint[)]"
[ "$(files_in L)" = "latest step-2.h5" ] || fail "files in L after the failed commit: $(files_in L)"
expect_latest L step-2.h5
train M 2 --train.steps=6 "${S[@]}" --ckpt.every=2 --ckpt.dir=L --train.log-file=M.jsonl
expect_rc M 0
expect_line M "resumed from .*L/step-2\.h5 at step 2 "
expect_no_line M "another line of training"
steplog steps M.jsonl 3 6
steplog same U.jsonl M.jsonl 3 6 1e-5
expect_latest L step-6.h5

# A failure after the commit (the retention's listing of the folder; here DT_TEST_CKPT_PRUNE_FAIL
# at the save of step 4): step-4.h5 is committed, so the run says so in a warning and trains on.
MPIEXEC=("${MPIEXEC[@]}" -x DT_TEST_CKPT_PRUNE_FAIL=0:step-4.h5)
train P 2 --train.steps=6 "${S[@]}" --ckpt.every=2 --ckpt.dir=P
MPIEXEC=("${MPIEXEC_PLAIN[@]}")
expect_rc P 0
expect_line P "^ckpt: warning: .*P/step-4\.h5 is committed, but after its commit: cannot list the checkpoint folder .*P: DT_TEST_CKPT_PRUNE_FAIL"
expect_no_line P "committing .* failed"
[ "$(files_in P)" = "latest step-2.h5 step-4.h5 step-6.h5" ] || fail "files in P: $(files_in P)"
expect_latest P step-6.h5

# A checkpoint the retention cannot remove (immutable: chattr +i, as a file system that refuses
# the unlink): the run says so in a warning, naming it, and trains on.
mkdir -p Q
train Q1 2 --train.steps=2 "${S[@]}" --ckpt.every=2 --ckpt.dir=Q --ckpt.keep=1
expect_rc Q1 0
# (Made removable again however the script ends: an immutable file would outlive the test.)
trap 'rc=$?; chattr -i "$WORK/Q/step-2.h5" 2>/dev/null; (exit $rc); cleanup' EXIT
if chattr +i Q/step-2.h5 2>/dev/null; then
  train Q2 2 --train.steps=4 "${S[@]}" --ckpt.every=2 --ckpt.dir=Q --ckpt.keep=1
  chattr -i Q/step-2.h5
  expect_rc Q2 0
  expect_line Q2 "^ckpt: warning: cannot remove .*Q/step-2\.h5 \(ckpt\.keep = 1\): Operation not permitted"
  [ "$(files_in Q)" = "latest step-2.h5 step-4.h5" ] || fail "files in Q: $(files_in Q)"
else
  echo "failed_save.sh: chattr +i is not possible here: the unremovable checkpoint is not tested"
fi
finish
