#!/usr/bin/env bash
# ckpt.async: --ckpt.async=true with --ckpt.every=2 over 6 steps commits step-2/4/6.h5 from host
# snapshots written in the background ("snapshot taken, blocked", "written in the background").
# Training is not disturbed, every file resumes (steps 2 and 4 continue exactly like a
# synchronous run; step 6 evaluates to the same loss) and the files hold the synchronous run's
# parameters and optimiser state. A background save that fails costs the run, not the steps
# since: the next save saves its step, then the run ends with the failure.
source "$(dirname "$0")/lib.sh"

RUN=(--train.steps=6 --ckpt.every=2 --ckpt.keep=3)
train S 2 "${RUN[@]}" --ckpt.dir=S --train.log-file=S.jsonl
expect_rc S 0
train A 2 "${RUN[@]}" --ckpt.dir=A --ckpt.async=true --train.log-file=A.jsonl
expect_rc A 0
for k in 2 4 6; do
  expect_line S "saved .*S/step-$k\.h5 .*blocking"
  expect_line A "step $k: snapshot taken, blocked [0-9.]+ ms"
  expect_line A "A/step-$k\.h5 written in the background"
done
expect_no_line A "blocking"
[ "$(files_in A)" = "latest step-2.h5 step-4.h5 step-6.h5" ] || fail "async files: $(files_in A)"
expect_latest A step-6.h5
steplog same S.jsonl A.jsonl 1 6 1e-6

# Resuming from each asynchronous checkpoint.
for k in 2 4; do
  train RA$k 2 --train.steps=6 --ckpt.resume="$WORK/A/step-$k.h5" --ckpt.dir=X$k \
    --train.log-file=RA$k.jsonl
  expect_rc RA$k 0
  expect_line RA$k "resumed from .*A/step-$k\.h5 at step $k "
  steplog steps RA$k.jsonl $((k + 1)) 6
  steplog same S.jsonl RA$k.jsonl $((k + 1)) 6 1e-5
done
train EA 2 --ckpt.resume="$WORK/A/step-6.h5" --eval-only --eval.sequences=8
expect_rc EA 0
expect_line EA "resumed from .*A/step-6\.h5 at step 6 "
train ES 2 --ckpt.resume="$WORK/S/step-6.h5" --eval-only --eval.sequences=8
expect_rc ES 0
la=$(eval_loss EA)
ls_=$(eval_loss ES)
if [ -n "$la" ] && [ -n "$ls_" ]; then
  steplog close "$la" "$ls_" 1e-6
else
  fail "no eval-only loss (async '$la', sync '$ls_')"
fi

# Same tensors in the files (h5diff: hdf5-tools, which scripts/bootstrap installs).
if ! command -v h5diff >/dev/null; then
  fail "h5diff is missing (install hdf5-tools): cannot compare the files"
  finish
fi
for k in 2 4 6; do
  expect_file "A/step-$k.h5"
  expect_file "S/step-$k.h5"
  for g in /model /optim; do
    h5diff -q "A/step-$k.h5" "S/step-$k.h5" "$g" "$g" ||
      fail "step-$k.h5: $g differs between the async and the sync run"
  done
done

# A background save that fails (step 2's, test.fail-save-at-step): the next save (step 4's)
# saves its step first, synchronously, then ends the run with the failure (exit 3). The steps
# since step 2 are not lost: step-4.h5 holds the synchronous run's step 4.
train F 2 "${RUN[@]}" --ckpt.dir=F --ckpt.async=true --test.fail-save-at-step=2
expect_rc F 3
expect_line F "ckpt: error: an earlier background save failed: .*test\.fail-save-at-step: the save of step 2 .*; saving step 4 now, before the run ends"
expect_line F "an earlier background save failed: .* \(step 4 was saved: .*F/step-4\.h5\)"
expect_no_line F "step 5"
expect_latest F step-4.h5
expect_file F/step-4.h5
for g in /model /optim; do
  h5diff -q F/step-4.h5 S/step-4.h5 "$g" "$g" || fail "F/step-4.h5: $g differs from S/step-4.h5"
done
finish
