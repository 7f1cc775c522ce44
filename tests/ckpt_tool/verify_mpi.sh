#!/usr/bin/env bash
# verify under mpiexec -n 2: the ranks share the hashing, rank 0 alone prints. The damage sits
# in the last chunk of the file's numbering, which rank 1 hashes.
. "$(dirname "$0")/common.sh"
run "${MPIEXEC[@]}" -n 2 "$DT_CKPT" verify "$CKPT"
expect_rc 0 "verify on 2 ranks"
expect_count 1 "^ok: $CKPT \(84 datasets, 84 chunks\)$"
cp "$CKPT" "$WORK/flipped.h5" || fail copy
flip "$WORK/flipped.h5" /optim/exp_avg_sq/transformer.ln_f.bias 8
run "${MPIEXEC[@]}" -n 2 "$DT_CKPT" verify "$WORK/flipped.h5"
expect_rc 1 "damage found on rank 1"
expect_count 1 "^FAILED: "
expect_count 1 "^  /optim/exp_avg_sq/transformer\.ln_f\.bias: checksum mismatch in chunk 0 \(of 1\)$"
run "$DT_CKPT" verify "$WORK/flipped.h5"
expect_rc 1 "damage found on 1 rank"
pass "verify on 2 ranks"
