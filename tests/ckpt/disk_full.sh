#!/usr/bin/env bash
# ckpt.disk_full: the checkpoint folder's file system (a tmpfs mounted for the test: root only,
# else SKIP) holds the previous checkpoint but has no room for the next. The save is refused on
# every rank before its file exists: exit code 3, naming the folder and the space needed and
# free; no partial file is left, and the previous checkpoint and latest stay as they were. Out of
# inodes for `latest` after the new file is written: that file is removed again, and the next
# run resumes from the previous checkpoint.
source "$(dirname "$0")/lib.sh"

S=(--optim.decay-steps=6)
train P 2 --train.steps=2 "${S[@]}" --ckpt.dir=D0
expect_rc P 0
expect_latest D0 step-2.h5
size=$(stat -c %s D0/step-2.h5)
mkdir -p M
if ! mount -t tmpfs -o size=$((size + 256 * 1024)) dt-ckpt-test M 2>mount.err; then
  echo "SKIP: cannot mount a tmpfs here (root only): $(cat mount.err)"
  exit 77
fi
unmount() { umount M 2>/dev/null || umount -l M 2>/dev/null || true; }
# (cleanup exits with the status it finds: the script's, kept through the unmount)
trap 'rc=$?; unmount; (exit $rc); cleanup' EXIT
cp -a D0 M/D
before=$(sha256sum <M/D/step-2.h5)
df -k M | sed 's/^/    /'

train F 2 --train.steps=6 "${S[@]}" --ckpt.every=2 --ckpt.dir=M/D
expect_rc F 3
expect_line F "resumed from .*M/D/step-2\.h5 at step 2 "
expect_line F "cannot save .*M/D/step-4\.h5: not enough space in .*M/D on rank [01]: the file needs about [0-9.]+ [KMG]iB, [0-9.]+ [KMG]iB are free"
expect_no_line F "saved .*step-4\.h5"
[ "$(files_in M/D)" = "latest step-2.h5" ] || fail "files in M/D: $(files_in M/D)"
expect_latest M/D step-2.h5
[ "$(sha256sum <M/D/step-2.h5)" = "$before" ] || fail "M/D/step-2.h5 changed"
unmount

# A file system with one inode free (filled with empty files, one removed): the new
# checkpoint's file is made and written, `latest` cannot be. The new file is removed, so that the
# folder is as it was (a complete step-4.h5 newer than `latest` was taken for another line of
# training by the next resume, and set aside), and the next run resumes from step 2 and trains on
# as the uninterrupted run.
mount -t tmpfs -o size=$((4 * size + 1024 * 1024)),nr_inodes=64 dt-ckpt-test M || fail "mount"
cp -a D0 M/D
mkdir M/fill
for i in $(seq 64); do touch "M/fill/$i" 2>/dev/null || break; done
[ -e M/fill/64 ] && fail "64 files fit in a tmpfs of 64 inodes"
rm -f "M/fill/$((i - 1))"
train I 2 --train.steps=6 "${S[@]}" --ckpt.every=2 --ckpt.dir=M/D
expect_rc I 3
expect_line I "committing .*M/D/step-4\.h5 failed: cannot write .*M/D/latest .*No space left on device.*M/D/step-4\.h5 removed [(]latest still names the previous checkpoint[)]"
[ "$(files_in M/D)" = "latest step-2.h5" ] || fail "files in M/D: $(files_in M/D)"
expect_latest M/D step-2.h5
[ "$(sha256sum <M/D/step-2.h5)" = "$before" ] || fail "M/D/step-2.h5 changed"
unmount  # (lazily where a rank of the aborted job still holds a file there)
mount -t tmpfs -o size=$((4 * size + 1024 * 1024)) dt-ckpt-test M || fail "mount"
cp -a D0 M/D
train U 2 --train.steps=4 "${S[@]}" --train.log-file=U.jsonl
expect_rc U 0
train R 2 --train.steps=4 "${S[@]}" --ckpt.dir=M/D --train.log-file=R.jsonl
expect_rc R 0
expect_line R "resumed from .*M/D/step-2\.h5 at step 2 "
expect_no_line R "another line of training"
steplog steps R.jsonl 3 4
steplog same U.jsonl R.jsonl 3 4 1e-5
expect_latest M/D step-4.h5
finish
