#!/usr/bin/env bash
# list under mpiexec -n 2, the ranks seeing the folder differently: the folder is named by a
# relative path and each rank starts in its own working directory (mpiexec's -wdir per
# application context). Rank 0's ckpts/ holds step-2.h5 and step-4.h5, rank 1's the same files
# (hard links) and a step-6.h5 besides, as a rank that lists the folder after a run committed
# step 6 sees it. Every rank verifies the files rank 0 listed: one list of two checkpoints,
# exit 0, where ranks verifying their own listings did a different number of collective
# verifications and hung. Then a file rank 0 lists that rank 1 no longer finds, and a folder
# rank 1 cannot see: agreed on, never a verification or listing on some ranks only.
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
# A file rank 0 lists that is gone for rank 1 (pruned by a run in between, say): the ranks agree
# it is not verified (rank 1's reason), exit 1, and none waits in a verification alone.
mkdir -p "$WORK/g0/ckpts" "$WORK/g1/ckpts" || fail "mkdir"
ln "$CKPTS/step-2.h5" "$CKPTS/step-4.h5" "$WORK/g0/ckpts/" && cp "$CKPTS/latest" "$WORK/g0/ckpts/" &&
  ln "$CKPTS/step-4.h5" "$WORK/g1/ckpts/" || fail "links in $WORK/g0, $WORK/g1"
run timeout 60 "${MPIEXEC[@]}" -n 1 -wdir "$WORK/g0" "$DT_CKPT" list ckpts : \
  -n 1 -wdir "$WORK/g1" "$DT_CKPT" list ckpts
expect_rc 1 "step-2.h5 gone for rank 1"
expect_line "^ +4 +step-4\.h5 +[0-9.]+ +yes +latest$"
expect_line "^ +2 +step-2\.h5 +[0-9.]+ +NO *$"
expect_line "step-2\.h5: .*ckpts/step-2\.h5"
# A folder rank 1 cannot see at all: refused on every rank, naming the rank (exit 2).
mkdir -p "$WORK/h1" || fail "mkdir"
run timeout 60 "${MPIEXEC[@]}" -n 1 -wdir "$WORK/g0" "$DT_CKPT" list ckpts : \
  -n 1 -wdir "$WORK/h1" "$DT_CKPT" list ckpts
expect_rc 2 "no folder on rank 1"
expect_line "ckpts: No such file or directory \(on rank 1\)"
# verify, export and import of a file, and a key file, that rank 1's node lacks: refused on every
# rank, naming rank 1 (exit 2), where rank 0 went on into the collective verification and hung.
mkdir -p "$WORK/k0" "$WORK/k1" || fail "mkdir"
ln "$CKPTS/step-4.h5" "$WORK/k0/" || fail "link step-4.h5"
head -c 32 /dev/urandom >"$WORK/k0/job.key" && chmod 600 "$WORK/k0/job.key" || fail "job.key"
run timeout 60 "${MPIEXEC[@]}" -n 1 -wdir "$WORK/k0" "$DT_CKPT" verify step-4.h5 : \
  -n 1 -wdir "$WORK/k1" "$DT_CKPT" verify step-4.h5
expect_rc 2 "verify: no file on rank 1"
expect_line "step-4\.h5.* \(on rank 1\)$"
run timeout 60 "${MPIEXEC[@]}" -n 1 -wdir "$WORK/k0" "$DT_CKPT" list "$CKPTS" \
  --security.key_file job.key : -n 1 -wdir "$WORK/k1" "$DT_CKPT" list "$CKPTS" \
  --security.key_file job.key
expect_rc 2 "list: no key file on rank 1"
expect_line "job\.key.* \(on rank 1\)$"
run timeout 60 "${MPIEXEC[@]}" -n 1 -wdir "$WORK/k0" "$DT_CKPT" export step-4.h5 --output e.st : \
  -n 1 -wdir "$WORK/k1" "$DT_CKPT" export step-4.h5 --output e.st
expect_rc 2 "export: no file on rank 1"
expect_line "step-4\.h5.* \(on rank 1\)$"
[ ! -e "$WORK/k0/e.st" ] || fail "export wrote $WORK/k0/e.st"
run "$DT_CKPT" export "$CKPTS/step-4.h5" --format safetensors --output "$WORK/k0/model.st"
expect_rc 0 "export of step-4.h5 for the import"
run timeout 60 "${MPIEXEC[@]}" -n 1 -wdir "$WORK/k0" "$DT_CKPT" import model.st --heads 2 \
  --output imp : -n 1 -wdir "$WORK/k1" "$DT_CKPT" import model.st --heads 2 --output imp
expect_rc 2 "import: no input on rank 1"
expect_line "model\.st.* \(on rank 1\)$"
[ ! -e "$WORK/k0/imp" ] || fail "import made $WORK/k0/imp"
# The same on one rank in rank 1's folder: its own listing, step-6.h5 named as holding step 4.
cd "$WORK/r1" || fail "cd"
run "$DT_CKPT" list ckpts
expect_rc 1 "step-6.h5 holds step 4"
expect_line "^ckpts: 3 checkpoints"
expect_line "step-6\.h5: holds step 4, its name says step 6"
pass "list on 2 ranks follows rank 0's listing"
