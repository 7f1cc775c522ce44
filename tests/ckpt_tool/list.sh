#!/usr/bin/env bash
# list: newest first, sizes, verified yes, latest marked; then a corrupt checkpoint (NO, exit 1)
# and an interrupted save in a copy of the folder; then two set-aside files and a writer holding
# the folder's lock (a real flock on .dt-lock, taken by flock(1)); last a checkpoint whose name
# says another step than it holds, and a `latest` that is a directory.
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
expect_line ": 2 checkpoints, 1 interrupted save, 0 set aside$"
expect_count 0 "in use by"

cp "$CKPTS/step-4.h5" "$dir/step-4.h5.superseded" && cp "$CKPTS/step-2.h5" "$dir/step-2.h5.superseded.2" ||
  fail "copy"
printf 'dt_train on node7, pid 4242, since 2026-01-01T00:00:00Z\n' > "$dir/.dt-lock"
# (The subshell holds the lock on its descriptor 9 and becomes the sleep: killing it ends both.)
( flock -x 9 && exec sleep 60 ) 9<>"$dir/.dt-lock" >/dev/null 2>&1 &
holder=$!
for _ in $(seq 50); do flock -n -s "$dir/.dt-lock" true || break; sleep 0.1; done
run "$DT_CKPT" list "$dir"
kill "$holder" 2>/dev/null
wait "$holder" 2>/dev/null
expect_line ": 2 checkpoints, 1 interrupted save, 2 set aside$"
expect_line "^in use by dt_train on node7, pid 4242, since 2026-01-01T00:00:00Z$"
expect_line "^ +- +step-4\.h5\.superseded +$(mb "$CKPTS/step-4.h5") +- +set aside$"
expect_line "^ +- +step-2\.h5\.superseded\.2 +$(mb "$CKPTS/step-2.h5") +- +set aside$"
expect_line "^note: the 2 set-aside files \([0-9.]+ MB\) are of another line of training"

# A checkpoint whose name says another step than it holds (renamed or copied by hand) fails, and
# a `latest` that is a directory is named as one.
named=$WORK/renamed
mkdir -p "$named/latest" && cp "$CKPTS/step-4.h5" "$named/step-007.h5" || fail "set-up"
run "$DT_CKPT" list "$named"
expect_rc 1 "the step in a checkpoint's name is not the one it holds"
expect_line "^ +7 +step-007\.h5 +[0-9.]+ +NO *$"
expect_line "^  step-007\.h5: holds step 4, its name says step 7 \(renamed or copied by hand\?\)$"
expect_line "^note: $named/latest is a directory, not the file naming the newest checkpoint"
expect_count 0 "missing or unreadable"
# verify of that file says the same (it said "ok").
run "$DT_CKPT" verify "$named/step-007.h5"
expect_rc 1 "verify of a checkpoint whose name says another step"
expect_line "^  holds step 4, its name says step 7 \(renamed or copied by hand\?\)$"
pass "list"
