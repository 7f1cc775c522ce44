#!/usr/bin/env bash
# ckpt.resume_fp16: the loss scaler's schedule survives a resume. fp16 on 2 ranks with injected
# overflows; a run resumed from its step-4 checkpoint continues the one that never stopped, step
# for step: losses, learning rates, loss scales and skipped steps. Two schedules, each of which a
# resume that forgot the scaler's state gets wrong:
#  - growth: growth interval 4, an overflow at step 3; the checkpoint of step 4 holds 1 clean
#    step in a row, so the scale doubles after step 7 (not after step 8);
#  - hysteresis 2 (the scale halves at the second overflow), overflows at steps 3 and 6; the
#    checkpoint of step 4 holds 1 overflow left, so the scale halves after step 6 (not after a
#    third overflow).
# The checkpoints of step 8 of both runs record the same schedule (dt_ckpt inspect). An fp16 run
# resumed from an fp32 checkpoint starts at the initial scale, not at the fp32 file's 1.
source "$(dirname "$0")/lib.sh"
DT_CKPT=$(dirname "$BIN")/dt_ckpt

FP16=(--train.steps=8 --train.log-every=1 --train.dtype=fp16 --test.inject-inf-rank=1
      --test.inject-inf-step=2)
schedule() {  # the loss scaler's attributes of a checkpoint
  "$DT_CKPT" inspect "$1" | grep -E '^  (loss_scale|loss_scale_growth_tracker|loss_scale_hysteresis_left|steps_skipped) = '
}

for kind in growth hysteresis; do
  case $kind in
    growth) ARGS=("${FP16[@]}" --loss-scale.growth-interval=4) ;;
    hysteresis) ARGS=("${FP16[@]}" --loss-scale.hysteresis=2 --test.inject-inf-every=3) ;;
  esac
  train "A-$kind" 2 "${ARGS[@]}" --ckpt.dir="A-$kind" --ckpt.every=4 --train.log-file="A-$kind.jsonl"
  expect_rc "A-$kind" 0
  expect_file "A-$kind/step-4.h5"
  train "R-$kind" 2 "${ARGS[@]}" --ckpt.resume="$WORK/A-$kind/step-4.h5" --ckpt.dir="R-$kind" \
    --ckpt.every=4 --train.log-file="R-$kind.jsonl"
  expect_rc "R-$kind" 0
  expect_line "R-$kind" "resumed from .*A-$kind/step-4\.h5 at step 4 "
  steplog steps "R-$kind.jsonl" 5 8
  steplog same "A-$kind.jsonl" "R-$kind.jsonl" 5 8 1e-5
  a=$(schedule "A-$kind/step-8.h5")
  r=$(schedule "R-$kind/step-8.h5")
  [ "$(printf '%s\n' "$a" | wc -l)" -eq 4 ] || fail "$kind: A-$kind/step-8.h5 lacks the scaler's attributes: $a"
  [ "$a" = "$r" ] || fail "$kind: the step-8 checkpoints record other schedules: $a | $r"
done
# The schedules did what the comment says (so the comparison above had something to catch).
ratio() {  # ratio FILE STEP1 STEP2: loss scale of STEP2 over that of STEP1
  python3 -c 'import sys; print(float(sys.argv[2]) / float(sys.argv[1]))' \
    "$($STEPLOG value "$1" "$2" loss_scale)" "$($STEPLOG value "$1" "$3" loss_scale)"
}
[ "$(ratio A-growth.jsonl 7 8)" = 2.0 ] || fail "growth: the scale did not double after step 7"
[ "$(ratio A-hysteresis.jsonl 6 7)" = 0.5 ] || fail "hysteresis: the scale did not halve after step 6"
printf '%s\n' "$(schedule A-hysteresis/step-8.h5)" | grep -qx '  steps_skipped = 2' ||
  fail "hysteresis: step-8.h5 does not record 2 skipped steps"

# An fp16 run resumed from an fp32 checkpoint (whose loss_scale is 1) starts at the initial scale,
# says so, and names the settings that differ from the checkpoint's. It also doubles the batch:
# the tokens its checkpoint says were seen are 3 steps of 8 sequences of 32 and 2 of 16.
train F 2 --train.steps=3 --train.log-every=1 --ckpt.dir=F
expect_rc F 0
train H 2 --train.steps=5 --train.log-every=1 --train.dtype=fp16 --ckpt.dir=F \
  --train.log-file=H.jsonl --train.batch=16
expect_rc H 0
expect_line H "resumed from .*F/step-3\.h5 at step 3 \(written by .*, 768 tokens seen\)"
"$DT_CKPT" inspect F/step-5.h5 | grep -qx '  tokens = 1792' ||
  fail "F/step-5.h5 does not say 1792 tokens seen: $("$DT_CKPT" inspect F/step-5.h5 | grep tokens)"
expect_line H "ckpt: the checkpoint was trained in fp32: the fp16 loss scale starts at --loss-scale.initial=65536"
expect_line H "ckpt: warning: settings differ from the checkpoint's \(train.batch 8 -> 16, train.steps 3 -> 5, optim.decay-steps 3 -> 5, train.dtype fp32 -> fp16\)"
python3 -c 'import sys; sys.exit(float(sys.argv[1]) != 65536)' "$($STEPLOG value H.jsonl 4 loss_scale)" ||
  fail "the fp16 run resumed from fp32 ran step 4 at loss scale $($STEPLOG value H.jsonl 4 loss_scale), not 65536"
finish
