#!/usr/bin/env bash
# ckpt.write_fail_one_rank: a save whose writes fail on one rank only, as on a node whose disk or
# quota fills up during the save: rank 1's writes past half the file's size fail for real (the
# kernel refuses them, EFBIG: a file size limit, ulimit -f, with SIGXFSZ ignored). The ranks' HDF5
# states then differ, so that closing the file together cannot work: the job ends at once (exit
# code 3) with rank 1's write error, instead of hanging in the close. The previous checkpoint and
# latest stay as they were, and the next run resumes from it and trains exactly like an
# uninterrupted run.
source "$(dirname "$0")/lib.sh"

# One learning-rate schedule for all runs, whatever --train.steps says.
S=(--optim.decay-steps=6)

train U 2 --train.steps=6 "${S[@]}" --train.log-file=U.jsonl
expect_rc U 0
train P 2 --train.steps=2 "${S[@]}" --ckpt.dir=D
expect_rc P 0
expect_latest D step-2.h5
size=$(stat -c %s D/step-2.h5)
before=$(sha256sum <D/step-2.h5)
limit_kb=$((size / 2 / 1024))
echo "step-2.h5: $size bytes; rank 1 may write files up to $limit_kb KiB"

args=(--config "$CONFIG" --data.path="$TEXT" --train.steps=6 "${S[@]}" --ckpt.every=2 --ckpt.dir=D)
echo "=== F: 2 ranks, rank 1 with ulimit -f $limit_kb: dt_train ${args[*]}"
t0=$SECONDS
# shellcheck disable=SC2016
timeout -k 10 "$RUN_LIMIT" "${MPIEXEC[@]}" -n 1 "$BIN" "${args[@]}" : \
  -n 1 bash -c 'trap "" XFSZ; ulimit -f "$0" && exec "$@"' "$limit_kb" "$BIN" "${args[@]}" \
  >F.out 2>&1
RC=$?
sed 's/^/    /' F.out
echo "=== F: exit code $RC after $((SECONDS - t0)) s"
[ "$RC" -ne 124 ] && [ "$RC" -ne 137 ] || fail "F: timed out after $RUN_LIMIT s (a hang)"
expect_rc F 3
expect_line F "resumed from .*D/step-2\.h5 at step 2 "
expect_line F "rank 1: writing .*D/step-4\.h5\.partial failed: .*H5Dwrite failed.*; the writes failed on some ranks only"
expect_line F "rank [01]: saving .*D/step-4\.h5\.partial failed on some ranks only; aborting the job"
expect_no_line F "saved .*step-4\.h5"
expect_no_file D/step-4.h5
expect_latest D step-2.h5
[ "$(sha256sum <D/step-2.h5)" = "$before" ] || fail "D/step-2.h5 changed"

resumes_like_uninterrupted 2 6 "${S[@]}" --ckpt.every=2
finish
