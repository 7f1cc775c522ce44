#!/usr/bin/env bash
# verify: ok with the dataset and chunk counts h5ls gives; one flipped byte in the data of
# /model/transformer.wte.weight is named with its chunk (exit 1); a truncated copy is named (exit 1);
# a copy whose object header of /model/transformer.ln_f.bias is damaged (HDF5 opens the file but
# cannot list its datasets) fails verification (exit 1), not as bad input (exit 2); root attributes
# of 64 values are refused, a variable-length string read.
. "$(dirname "$0")/common.sh"
read -r ndata nchunks < <(h5ls -r "$CKPT" | grep ' Dataset {' | grep -v '^/checksums/' |
  sed -E 's/.*\{([^}]*)\}/\1/' |
  awk -F', ' '{ p = 1; for (i = 1; i <= NF; i++) p *= $i; n++; c += int((p + 262143) / 262144) }
              END { print n, c }')
run "$DT_CKPT" verify "$CKPT"
expect_rc 0 "verify"
expect_line "^ok: $CKPT \($ndata datasets, $nchunks chunks\)$"

cp "$CKPT" "$WORK/flipped.h5" || fail copy
flip "$WORK/flipped.h5" /model/transformer.wte.weight
cmp -l "$CKPT" "$WORK/flipped.h5" | wc -l | grep -qx 1 || fail "the copy differs in more than one byte"
run "$DT_CKPT" verify "$WORK/flipped.h5"
expect_rc 1 "flipped byte"
expect_line "^FAILED: $WORK/flipped.h5 \(1 problem\)$"
expect_line "^  /model/transformer\.wte\.weight: checksum mismatch in chunk 0 \(of 1\)$"

cp "$CKPT" "$WORK/truncated.h5" && truncate -s $(($(stat -c %s "$CKPT") / 2)) "$WORK/truncated.h5" ||
  fail "truncate"
run "$DT_CKPT" verify "$WORK/truncated.h5"
expect_rc 1 "truncated copy"
expect_line "$WORK/truncated\.h5: .*truncated"
cp "$CKPT" "$WORK/header.h5" || fail copy
addr=$(h5ls -v "$WORK/header.h5/model/transformer.ln_f.bias" | sed -nE 's/^ *Location: *[0-9]+:([0-9]+).*/\1/p')
[ -n "$addr" ] || fail "h5ls gives no object header address of /model/transformer.ln_f.bias"
printf '\x07' | dd of="$WORK/header.h5" bs=1 seek="$addr" conv=notrunc status=none || fail dd
run "$DT_CKPT" verify "$WORK/header.h5"
expect_rc 1 "damaged object header"
expect_line "^FAILED: $WORK/header.h5 "
# 512 zero bytes at byte 1024 (in the root group's symbol table: HDF5 opens the file, its root
# group does not open): damaged (exit 1), not bad input (exit 2).
cp "$CKPT" "$WORK/root.h5" || fail copy
dd if=/dev/zero of="$WORK/root.h5" bs=1 seek=1024 count=512 conv=notrunc status=none || fail dd
run "$DT_CKPT" verify "$WORK/root.h5"
expect_rc 1 "damaged root group"
expect_line "^FAILED: $WORK/root.h5 "
# inspect stops there too (reading the attributes of a file HDF5 cannot list can crash inside
# HDF5): exit 1, naming it as damaged.
run "$DT_CKPT" inspect "$WORK/header.h5"
expect_rc 1 "inspect of a damaged object header"
expect_line "^dt_ckpt inspect: $WORK/header.h5 is damaged: HDF5's default \(serial\) driver cannot open it"
# One bit of the superblock's driver-information address (byte 53) flipped: MPI-IO, which the
# checks read through, does not use it, but HDF5's default driver (inspect, export, h5py) cannot
# open the file: damaged (exit 1), not "ok" with no datasets.
cp "$CKPT" "$WORK/super.h5" || fail copy
python3 -c "import sys; f = open(sys.argv[1], 'r+b'); f.seek(53); b = f.read(1)[0]; f.seek(53); f.write(bytes([b ^ 1]))" \
  "$WORK/super.h5" || fail "flipping byte 53"
run "$DT_CKPT" inspect "$WORK/super.h5"
[ "$RC" -ne 0 ] ||
  fail "inspect still opens the copy with byte 53 flipped (the superblock is laid out otherwise)"
run "$DT_CKPT" verify "$WORK/super.h5"
expect_rc 1 "superblock field flipped"
expect_line "^  HDF5's default \(serial\) driver cannot open the file or list its datasets"
# Root attributes a hostile or careless writer changed (DT_H5_EDIT): `step` or `layout` as an
# array of 64 strings, which a read of one value would overrun (a layout array crashed dt_ckpt):
# damaged (exit 1), naming the attribute; `format` as a variable-length string (h5py's str)
# holds the same text as a fixed-length one: ok (it was read as garbage, "not a dt checkpoint").
for attr in step layout; do
  cp "$CKPT" "$WORK/array-$attr.h5" || fail copy
  "$DT_H5_EDIT" "$WORK/array-$attr.h5" set-attr-array "$attr" 3 64 || fail "h5_edit set-attr-array"
  run "$DT_CKPT" verify "$WORK/array-$attr.h5"
  expect_rc 1 "$attr as an array of 64 values"
  expect_line "attribute '$attr' holds 64 values, not one"
done
cp "$CKPT" "$WORK/vlen.h5" || fail copy
"$DT_H5_EDIT" "$WORK/vlen.h5" set-attr-vlen format dt-checkpoint || fail "h5_edit set-attr-vlen"
run "$DT_CKPT" verify "$WORK/vlen.h5"
expect_rc 0 "format as a variable-length string"
expect_line "^ok: $WORK/vlen\.h5 "
pass "verify"
