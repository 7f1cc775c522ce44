#!/usr/bin/env bash
# ckpt.device_memory: training on a device whose memory the host cannot touch (the CPU kernels
# built as test-plugins/libdt_hal_devmem.so: every host access to its memory faults) equals
# training on the CPU device, and its checkpoints go through host copies both ways: 2 ranks
# (gradients staged through the host communicator) save at step 4; the save equals the CPU
# run's tensors; 1 rank on the device resumes from it and continues the uninterrupted run. The
# same with tp=2 pp=2 saving and pp=2 resuming.
source "$(dirname "$0")/lib.sh"
DEV=(--runtime.device=devmem --runtime.plugin-path="$(dirname "$BIN")/../test-plugins")

train A 2 --train.steps=8 --train.log-file=A.jsonl --ckpt.dir=CA --ckpt.every=4
expect_rc A 0
train B 2 --train.steps=8 --train.log-file=B.jsonl --ckpt.dir=CB --ckpt.every=4 "${DEV[@]}" \
  --sample.tokens=16
expect_rc B 0
expect_line B "^dt_train: sample:"
# Every step and validation loss equal the CPU device's (the same kernels, staged reductions).
steplog same A.jsonl B.jsonl 1 8 0
# The checkpoint holds what the CPU run's holds, bit for bit.
for t in /model/transformer.h.0.attn.c_attn.weight /optim/exp_avg/transformer.wte.weight \
  /optim/exp_avg_sq/transformer.ln_f.bias; do
  h5dump -d "$t" -b NATIVE -o a.bin CA/step-4.h5 >/dev/null || fail "h5dump: no $t in CA"
  h5dump -d "$t" -b NATIVE -o b.bin CB/step-4.h5 >/dev/null || fail "h5dump: no $t in CB"
  [ -s a.bin ] || fail "h5dump wrote no values of $t"
  cmp -s a.bin b.bin || fail "$t differs between the CPU and the device checkpoint"
  rm -f a.bin b.bin
done
train R 1 --train.steps=8 --ckpt.resume="$WORK/CB/step-4.h5" --ckpt.dir=CR \
  --train.log-file=R.jsonl "${DEV[@]}"
expect_rc R 0
expect_line R "resumed from .*CB/step-4\.h5 at step 4 "
steplog steps R.jsonl 5 8
steplog same A.jsonl R.jsonl 5 8 1e-5
# The stage engine on device memory: tensor- and pipeline-parallel shards saved as pieces through
# the host copy, resumed on another layout.
train T 4 --train.steps=8 --train.log-file=T.jsonl --ckpt.dir=CT --ckpt.every=4 \
  --parallel.tp=2 --parallel.pp=2 "${DEV[@]}"
expect_rc T 0
steplog same A.jsonl T.jsonl 1 8 1e-5
train P 2 --train.steps=8 --ckpt.resume="$WORK/CT/step-4.h5" --ckpt.dir=CP \
  --train.log-file=P.jsonl --parallel.pp=2 "${DEV[@]}"
expect_rc P 0
expect_line P "resumed from .*CT/step-4\.h5 at step 4 .*written by dp=1 tp=2 pp=2"
steplog steps P.jsonl 5 8
steplog same A.jsonl P.jsonl 5 8 1e-5
finish
