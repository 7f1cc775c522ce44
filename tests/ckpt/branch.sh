#!/usr/bin/env bash
# ckpt.branch: a run resumed from an older checkpoint branches off. Its saves count as the
# newest: --ckpt.keep=1 leaves only its own file as a checkpoint, and the stale step-8 of the old
# branch is set aside (renamed step-8.h5.superseded, the same bytes, named in the log), never
# deleted; latest names the new file, and the next auto-resume continues the new branch, not the
# set-aside file; a second set-aside file of a step takes the next free name, and a commit removes
# temporary files of latest that an ended run left. A file name with a step number too large for
# 64 bits is ignored, not a crash.
source "$(dirname "$0")/lib.sh"

train A 2 --train.steps=8 --ckpt.every=4 --ckpt.dir=D
expect_rc A 0
[ "$(files_in D)" = "latest step-4.h5 step-8.h5" ] || fail "after A: $(files_in D)"
sum8=$(sha256sum <D/step-8.h5)
train B 2 --train.steps=6 --ckpt.dir=D --ckpt.keep=1 --ckpt.resume=D/step-4.h5
expect_rc B 0
expect_line B "resumed from .*D/step-4\.h5 at step 4 "
expect_line B "set aside .*D/step-8\.h5 -> .*D/step-8\.h5\.superseded: its step is not below"
[ "$(files_in D)" = "latest step-6.h5 step-8.h5.superseded" ] || fail "after B (keep=1): $(files_in D)"
[ "$(sha256sum <D/step-8.h5.superseded)" = "$sum8" ] || fail "the set-aside step-8 changed"
expect_latest D step-6.h5
cp D/step-6.h5 D/step-99999999999999999999.h5
train C 1 --train.steps=6 --ckpt.dir=D --eval-only --eval.sequences=4
expect_rc C 0
expect_line C "resumed from .*D/step-6\.h5 at step 6 "
# A second file of step 8 to set aside: the name taken is passed over, not replaced.
cp D/step-6.h5 D/step-8.h5
echo step-3.h5 >D/latest.tmp.999999.1  # left by a run that ended before renaming it
train E 2 --train.steps=7 --ckpt.dir=D --ckpt.keep=1 --ckpt.resume=D/step-6.h5
expect_rc E 0
expect_line E "set aside .*D/step-8\.h5 -> .*D/step-8\.h5\.superseded\.2: its step is not below"
[ "$(sha256sum <D/step-8.h5.superseded)" = "$sum8" ] || fail "the first set-aside step-8 changed"
[ ! -e D/latest.tmp.999999.1 ] || fail "a temporary file of latest left by another run is still there"
finish
