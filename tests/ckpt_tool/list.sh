#!/usr/bin/env bash
# list: newest first, sizes, verified yes, latest marked; then a corrupt checkpoint (NO, exit 1)
# and an interrupted save in a copy of the folder.
. "$(dirname "$0")/common.sh"
run "$DT_CKPT" list "$CKPTS"
expect_rc 0 "all checkpoints verify"
mb() { awk -v b="$(stat -c %s "$1")" 'BEGIN { printf "%.2f", b / 1e6 }'; }
expect_line "^ +4 +step-4\.h5 +$(mb "$CKPTS/step-4.h5") +yes +latest$"
expect_line "^ +2 +step-2\.h5 +$(mb "$CKPTS/step-2.h5") +yes *$"
expect_count 1 "latest"
first=$(printf '%s\n' "$OUT" | grep -nE 'step-4\.h5' | cut -d: -f1)
second=$(printf '%s\n' "$OUT" | grep -nE 'step-2\.h5' | cut -d: -f1)
[ "$first" -lt "$second" ] || fail "step-4.h5 is not listed before step-2.h5"

dir=$WORK/ckpts
mkdir -p "$dir" && cp "$CKPTS"/step-*.h5 "$CKPTS/latest" "$dir/" || fail "copy"
flip "$dir/step-2.h5" /model/transformer.wte.weight
head -c 4096 "$dir/step-4.h5" > "$dir/step-6.h5.partial"
run "$DT_CKPT" list "$dir"
expect_rc 1 "a checkpoint fails verification"
expect_line "^ +4 +step-4\.h5 +[0-9.]+ +yes +latest$"
expect_line "^ +2 +step-2\.h5 +[0-9.]+ +NO *$"
expect_line "step-2\.h5: /model/transformer\.wte\.weight: checksum mismatch in chunk 0"
expect_line "^ +- +step-6\.h5\.partial +[0-9.]+ +- +interrupted$"
pass "list"
