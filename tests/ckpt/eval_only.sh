#!/usr/bin/env bash
# ckpt.eval_only (MODE -): --eval-only --ckpt.resume=PATH --eval.sequences=8 prints
# "eval-only: step N ... loss X" and exits 0, with the same loss on 1, 2 and 3 ranks (1e-6
# relative; 3 ranks do not divide the training batch of 8, which evaluation does not need, also
# with --train.micro-batch=4); it trains and saves nothing. --eval-only without any checkpoint option exits 2.
# train.eval-windows, a setting of training's evaluations, does not bind it; without a validation
# split (--data.val-fraction=0) it exits 2 saying so.
# ckpt.eval_only_empty_dir (MODE empty_dir): --eval-only with --ckpt.dir naming a directory
# without checkpoints (auto-resume finds nothing), or none at all, has no checkpoint to evaluate
# either: exit 2, before the model is made, instead of reporting the loss of the random initial
# weights.
source "$(dirname "$0")/lib.sh"

case "$MODE" in
  -)
    train C 2 --train.steps=4 --ckpt.dir=D
    expect_rc C 0
    expect_file D/step-4.h5
    before=$(files_in D)
    for R in 1 2 3 3m; do
      micro=()
      [ "$R" = 3m ] && micro=(--train.micro-batch=4)
      train E$R "${R%m}" --eval-only --ckpt.resume="$WORK/D/step-4.h5" --eval.sequences=8 \
        --ckpt.dir=X$R "${micro[@]}"
      expect_rc E$R 0
      expect_line E$R "eval-only: step 4,.* loss [0-9]+\.[0-9]+"
      expect_line E$R "resumed from .*D/step-4\.h5 at step 4 "
      expect_no_line E$R "val loss|saved"
      # (C trained for 4 steps, these would for micro.ini's: no matter to an evaluation.)
      expect_no_line E$R "settings differ"
      [ ! -e X$R ] || fail "E$R: --eval-only wrote into its ckpt.dir: $(files_in X$R)"
    done
    # Another validation split is said: the loss is of other data than the training's.
    train EV 1 --eval-only --ckpt.resume="$WORK/D/step-4.h5" --eval.sequences=8 \
      --data.val-fraction=0.2
    expect_rc EV 0
    expect_line EV "settings differ from the checkpoint's [(]data.val-fraction 0.1 -> 0.2[)]: the evaluation is not on the data the checkpoint was trained on"
    # --eval-only evaluates eval.sequences in order: train.eval-windows (more windows than the
    # split has starts, here) is not its setting; without a validation split it is refused so.
    train EW 1 --eval-only --ckpt.resume="$WORK/D/step-4.h5" --eval.sequences=8 \
      --train.eval-windows=100000000
    expect_rc EW 0
    expect_line EW "eval-only: step 4,.* loss [0-9]+\.[0-9]+"
    train EZ 1 --eval-only --ckpt.resume="$WORK/D/step-4.h5" --data.val-fraction=0
    expect_rc EZ 2
    expect_line EZ "option --eval-only evaluates the validation split, and --data.val-fraction=0 leaves none"
    l1=$(eval_loss E1)
    l2=$(eval_loss E2)
    if [ -n "$l1" ] && [ -n "$l2" ]; then
      steplog close "$l1" "$l2" 1e-6
    else
      fail "no eval-only loss (1 rank '$l1', 2 ranks '$l2')"
    fi
    for R in 3 3m; do
      l3=$(eval_loss E$R)
      if [ -n "$l3" ] && [ -n "$l1" ]; then steplog close "$l3" "$l1" 1e-6; else fail "E$R: no eval-only loss"; fi
    done
    # Auto-resume of the directory evaluates the same file.
    train EA 2 --eval-only --ckpt.dir=D --eval.sequences=8
    expect_rc EA 0
    expect_line EA "resumed from .*D/step-4\.h5 at step 4 "
    la=$(eval_loss EA)
    if [ -n "$la" ]; then steplog close "$la" "$l2" 1e-6; else fail "EA: no eval-only loss"; fi
    [ "$(files_in D)" = "$before" ] || fail "D changed: $before -> $(files_in D)"
    # A finished run's checkpoint: nothing to train, and the sample asked for is still printed
    # (the same on 2 ranks through the pipeline engine, which assembles its stages first).
    for L in "" pp; do
      layout=()
      [ "$L" = pp ] && layout=(--parallel.pp=2)
      train S$L 2 --ckpt.resume="$WORK/D/step-4.h5" --train.steps=4 --sample.tokens=30 "${layout[@]}"
      expect_rc S$L 0
      expect_line S$L "nothing to train: the checkpoint is at step 4"
      expect_line S$L "^dt_train: sample:"
    done
    [ "$(grep -A2 '^dt_train: sample:' S.out)" = "$(grep -A2 '^dt_train: sample:' Spp.out)" ] ||
      fail "the samples of the fused model and the pipeline differ"
    # No checkpoint at all.
    train N 1 --eval-only --eval.sequences=8
    expect_rc N 2
    expect_line N "eval-only"
    expect_no_line N "eval-only: step"
    ;;
  empty_dir)
    mkdir -p EMPTY
    train N 1 --eval-only --ckpt.dir="$WORK/EMPTY" --eval.sequences=8
    expect_rc N 2
    expect_line N "option --eval-only: no checkpoint to evaluate in '.*/EMPTY'"
    expect_no_line N "eval-only: step"
    expect_no_line N "starting from step 0"
    expect_no_line N "dt_train: [0-9]+ parameters"  # refused before the model is made
    train M 2 --eval-only --ckpt.dir="$WORK/MISSING" --eval.sequences=8
    expect_rc M 2
    expect_line M "option --eval-only: no checkpoint to evaluate in '.*/MISSING'"
    expect_no_line M "eval-only: step"
    expect_no_line M "dt_train: [0-9]+ parameters"
    train O 1 --eval-only --eval.sequences=8
    expect_rc O 2
    expect_line O "option --eval-only needs a checkpoint: --ckpt.resume=PATH or --ckpt.dir"
    expect_no_line O "dt_train: [0-9]+ parameters"
    ;;
  *)
    echo "unknown mode '$MODE'"
    exit 2
    ;;
esac
finish
