#!/usr/bin/env bash
# ckpt.kill_during_save: rank 1 dies (SIGKILL) after writing its data into step-6.h5.partial and
# before the commit. The job fails, step-3.h5 and latest stay intact, and the next auto-resume
# names the interrupted save, resumes at step 3 and trains exactly like an uninterrupted run.
source "$(dirname "$0")/lib.sh"

# One learning-rate schedule for all runs, whatever --train.steps says.
S=(--optim.decay-steps=9)

train U 2 --train.steps=9 "${S[@]}" --train.log-file=U.jsonl
expect_rc U 0

# A clean checkpoint at step 3.
train C 2 --train.steps=3 "${S[@]}" --ckpt.every=3 --ckpt.dir=D
expect_rc C 0
expect_file D/step-3.h5
expect_latest D step-3.h5
size3=$(stat -c %s D/step-3.h5)
sum3=$(cksum <D/step-3.h5)

# Resume from it; the save at step 6 dies on rank 1.
train K 2 --train.steps=9 "${S[@]}" --ckpt.every=3 --ckpt.dir=D --test.kill-during-save=1
expect_rc K nonzero
expect_line K "resumed from .*D/step-3\.h5 at step 3 "
expect_no_line K "saved .*step-6\.h5"
expect_no_file D/step-6.h5
expect_no_file D/step-9.h5
expect_file D/step-3.h5
expect_latest D step-3.h5
[ "$(cksum <D/step-3.h5)" = "$sum3" ] || fail "D/step-3.h5 changed (size $size3 -> $(stat -c %s D/step-3.h5))"
# The kill comes after every rank has written and closed step-6.h5.partial, and only the commit
# removes it: it must be there.
left=$(files_in D)
echo "after the kill: $left"
[ "$left" = "latest step-3.h5 step-6.h5.partial" ] ||
  fail "unexpected files after the killed save: $left"

# A normal run: reports the leftover by name, resumes at step 3, finishes.
resumes_like_uninterrupted 3 9 "${S[@]}" --ckpt.every=3
expect_line N "ignoring interrupted save .*D/step-6\.h5\.partial"
[ "$(files_in D)" = "latest step-3.h5 step-6.h5 step-9.h5" ] || fail "files at the end: $(files_in D)"
finish
