#!/usr/bin/env bash
# inspect: every root attribute (as h5dump sees them), the config as indented lines, and every
# dataset outside /checksums (as h5ls sees them) with shape, dtype and size.
. "$(dirname "$0")/common.sh"
run "$DT_CKPT" inspect "$CKPT"
expect_rc 0 "inspect"
for a in $(h5dump -H "$CKPT" | sed -nE 's/^   ATTRIBUTE "([^"]+)".*/\1/p'); do
  printf '%s\n' "$OUT" | grep -Eq "^  $a( = |:$)" || fail "attribute $a is not shown"
done
[ "$(h5dump -H "$CKPT" | grep -c '^   ATTRIBUTE')" -eq 19 ] || fail "h5dump does not see 19 attributes"
for line in "  format = dt-checkpoint" "  format_version = 4" "  step = 4" "  tokens = 1024" \
            "  optimizer_step = 4" "  data_position = 4" "  rng_seed = 1337" "  loss_scale = 1" \
            "  loss_scale_growth_tracker = -1" "  loss_scale_hysteresis_left = -1" "  steps_skipped = -1" \
            "  layout = dp=1 tp=1 pp=1" "  chunk_elements = 262144" "  config:" "    model.embd = 32" \
            "    model.layers = 2" "    ckpt.every = 2" "    train.steps = 4"; do
  printf '%s\n' "$OUT" | grep -qxF -- "$line" || fail "no line '$line'"
done
flat=$(printf '%s\n' "$OUT" | tr -s ' ')
n=0
while read -r name dims; do
  case $name in /checksums/*) continue ;; esac
  dims=${dims#Dataset \{}
  dims=${dims%\}}
  numel=$(echo "$dims" | tr ',' '\n' | awk '{ p = (NR == 1 ? $1 : p * $1) } END { print p }')
  want=" $name [$dims] float32 $((numel * 4)) "
  printf '%s\n' "$flat" | grep -qF -- "$want" || fail "no dataset line '$want'"
  n=$((n + 1))
done < <(h5ls -r "$CKPT" | grep ' Dataset {')
[ "$n" -eq 84 ] || fail "h5ls lists $n datasets outside /checksums, expected 84"
expect_line "^datasets: $n,"
first=$(printf '%s\n' "$OUT" | sed -n '/^datasets:/,$p' | grep -m1 -E '^  /' | awk '{print $1}')
[ "$first" = /model/transformer.wte.weight ] || fail "the first dataset is $first"
# An attribute with control bytes (a damaged file, or one made to drive the terminal), an 8-bit
# CSI among them: shown as \xHH, never as the bytes themselves; the file is a copy.
cp "$CKPT" "$WORK/planted.h5"
"$DT_H5_EDIT" "$WORK/planted.h5" set-attr layout $'dp=1\e[2J\e]0;owned\a tp=1\r\x9b2J' ||
  fail "h5_edit set-attr failed"
run "$DT_CKPT" inspect "$WORK/planted.h5"
expect_rc 0 "inspect of a file with control bytes in an attribute"
printf '%s\n' "$OUT" | grep -qxF '  layout = dp=1\x1b[2J\x1b]0;owned\x07 tp=1\x0d\x9b2J' ||
  fail "the planted attribute is not shown with its control bytes as \\xHH"
! printf '%s' "$OUT" | LC_ALL=C grep -q $'[\x01-\x08\x0b-\x1f\x7f\x9b]' ||
  fail "inspect printed a control byte"
pass "$n datasets, 18 attributes; control bytes escaped"
