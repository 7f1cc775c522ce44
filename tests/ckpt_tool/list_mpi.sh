#!/usr/bin/env bash
# list under mpiexec -n 2, the ranks seeing the folder differently: the folder is named by a
# relative path and each rank starts in its own working directory (mpiexec's -wdir per
# application context). Rank 0's ckpts/ holds step-2.h5 and step-4.h5, rank 1's the same files
# (hard links) and a step-6.h5 besides, as a rank that lists the folder after a run committed
# step 6 sees it. Every rank verifies the files rank 0 listed: one list of two checkpoints,
# exit 0, where ranks verifying their own listings did a different number of collective
# verifications and hung.
. "$(dirname "$0")/common.sh"
mkdir -p "$WORK/r0/ckpts" "$WORK/r1/ckpts" || fail "mkdir"
for r in r0 r1; do
  ln "$CKPTS/step-2.h5" "$CKPTS/step-4.h5" "$WORK/$r/ckpts/" && cp "$CKPTS/latest" "$WORK/$r/ckpts/" ||
    fail "links in $WORK/$r/ckpts"
done
ln "$CKPTS/step-4.h5" "$WORK/r1/ckpts/step-6.h5" || fail "link step-6.h5"
run timeout 60 "${MPIEXEC[@]}" -n 1 -wdir "$WORK/r0" "$DT_CKPT" list ckpts : \
  -n 1 -wdir "$WORK/r1" "$DT_CKPT" list ckpts
expect_rc 0 "list on 2 ranks with rank 0's listing"
expect_count 1 "^ckpts: 2 checkpoints, 0 interrupted saves, 0 set aside$"
expect_line "^ +4 +step-4\.h5 +[0-9.]+ +yes +latest$"
expect_line "^ +2 +step-2\.h5 +[0-9.]+ +yes *$"
expect_count 0 "step-6"
# The same on one rank in rank 1's folder: its own listing, step-6.h5 named as holding step 4.
cd "$WORK/r1" || fail "cd"
run "$DT_CKPT" list ckpts
expect_rc 1 "step-6.h5 holds step 4"
expect_line "^ckpts: 3 checkpoints"
expect_line "step-6\.h5: holds step 4, its name says step 6"
pass "list on 2 ranks follows rank 0's listing"
