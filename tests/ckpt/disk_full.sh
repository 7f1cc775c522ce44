#!/usr/bin/env bash
# ckpt.disk_full: the checkpoint folder's file system (a tmpfs mounted for the test: root only,
# else SKIP) holds the previous checkpoint but has no room for the next. The save is refused on
# every rank before its file exists: exit code 3, naming the folder and the space needed and
# free; no partial file is left, and the previous checkpoint and latest stay as they were. The
# partial file of an interrupted save takes room too: a run's save removes it first (the run
# holds the folder) and then fits where it would not fit beside it.
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
unmount() { umount M 2>/dev/null || umount -l M 2>/dev/null; }
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

# Room for step-2.h5 and the space a save asks for (F's refusal said how much), not for a
# partial file of step-2.h5's size beside them: step-3.h5.partial (an interrupted save) takes it
# until the save of step 4 removes it.
read -r need unit < <(sed -nE 's/.*the file needs about ([0-9.]+) ([KM]iB).*/\1 \2/p' F.out | head -n1)
[ -n "${need:-}" ] || { fail "F does not say the space its save needs in KiB or MiB"; finish; }
need=$(awk -v k="$need" -v u="$unit" 'BEGIN { printf "%d", k * (u == "MiB" ? 1048576 : 1024) + 4096 }')
mkdir -p M2
mount -t tmpfs -o size=$((size + need + size / 2)) dt-ckpt-test M2 2>mount.err ||
  fail "cannot mount a second tmpfs: $(cat mount.err)"
trap 'rc=$?; unmount; umount M2 2>/dev/null || umount -l M2 2>/dev/null; (exit $rc); cleanup' EXIT
cp -a D0 M2/D
cp D0/step-2.h5 M2/D/step-3.h5.partial
df -k M2 | sed 's/^/    /'
train G 2 --train.steps=4 "${S[@]}" --ckpt.every=2 --ckpt.dir=M2/D
expect_rc G 0
expect_line G "ignoring interrupted save .*M2/D/step-3\.h5\.partial"
expect_no_line G "not enough space"
[ "$(files_in M2/D)" = "latest step-2.h5 step-4.h5" ] || fail "files in M2/D: $(files_in M2/D)"
expect_latest M2/D step-4.h5
finish
