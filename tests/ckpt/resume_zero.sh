#!/usr/bin/env bash
# parallel.zero.ckpt: checkpoints of sharded data parallelism stay global. With parallel.zero=3
# on 4 ranks each rank writes its own range of every tensor (dt_ckpt verify passes on the file);
# the checkpoint resumes with zero=0 on one rank and continues a single-rank run that never
# stopped; a single-rank checkpoint resumes with zero=2 on 2 ranks and zero=3 on 4 ranks (each
# reading other ranges); ZeRO-1/2/3 with pipeline and tensor parallelism write and resume global
# checkpoints; and an encrypted background save of zero=2 resumes too (losses, learning rates and
# validation losses within 1e-5 relative).
source "$(dirname "$0")/lib.sh"
DT_CKPT="$(dirname "$BIN")/dt_ckpt"
umask 077
head -c 32 /dev/urandom >key.bin

train A 1 --train.steps=8 --train.log-file=A.jsonl
expect_rc A 0

train Z 4 --train.steps=8 --parallel.zero=3 --ckpt.dir=D --ckpt.every=4 --train.log-file=Z.jsonl
expect_rc Z 0
expect_file D/step-4.h5
expect_line Z "memory per rank \(parallel.zero=3"
steplog same A.jsonl Z.jsonl 1 8 1e-5
"$DT_CKPT" verify D/step-4.h5 >verify.out 2>&1 || fail "dt_ckpt verify D/step-4.h5: $(cat verify.out)"

train R1 1 --train.steps=8 --ckpt.resume="$WORK/D/step-4.h5" --ckpt.dir=E1 \
  --train.log-file=R1.jsonl
expect_rc R1 0
expect_line R1 "resumed from .*D/step-4\.h5 at step 4 "
steplog steps R1.jsonl 5 8
steplog same A.jsonl R1.jsonl 5 8 1e-5

train W 1 --train.steps=8 --ckpt.dir=G --ckpt.every=4
expect_rc W 0
expect_file G/step-4.h5
for z in 2:2 3:4; do
  stage=${z%:*} ranks=${z#*:}
  train "S$stage" "$ranks" --train.steps=8 --parallel.zero="$stage" \
    --ckpt.resume="$WORK/G/step-4.h5" --ckpt.dir="H$stage" --train.log-file="S$stage.jsonl"
  expect_rc "S$stage" 0
  expect_line "S$stage" "resumed from .*G/step-4\.h5 at step 4 "
  steplog steps "S$stage.jsonl" 5 8
  steplog same A.jsonl "S$stage.jsonl" 5 8 1e-5
done

# ZeRO-1 and ZeRO-3 (parameters gathered per layer on each stage) with pipeline stages (dp=2
# pp=2) and ZeRO-2 with tensor parallelism (dp=2 tp=2: each rank writes its slice of its
# column and q|k|v shards): written (dt_ckpt verify passes) and resumed on one rank; the
# single-rank checkpoint resumed with dp=2 tp=2 and zero=1 or 2.
for spec in pp:1 pp:3 tp:2; do
  dim=${spec%:*} z=${spec#*:}
  train "P$z" 4 --train.steps=8 --parallel."$dim"=2 --parallel.zero="$z" --ckpt.dir="M$z" \
    --ckpt.every=4 --train.log-file="P$z.jsonl"
  expect_rc "P$z" 0
  want=$([ "$dim" = pp ] && echo "dp=2 tp=1 pp=2" || echo "dp=2 tp=2 pp=1")
  expect_line "P$z" "layout $want$"
  expect_line "P$z" "memory per rank \(parallel.zero=$z"
  steplog same A.jsonl "P$z.jsonl" 1 8 1e-5
  "$DT_CKPT" verify "M$z/step-4.h5" >"verify$z.out" 2>&1 ||
    fail "dt_ckpt verify M$z/step-4.h5: $(cat "verify$z.out")"
  train "RP$z" 1 --train.steps=8 --ckpt.resume="$WORK/M$z/step-4.h5" --ckpt.dir="N1$z" \
    --train.log-file="RP$z.jsonl"
  expect_rc "RP$z" 0
  expect_line "RP$z" "written by $want"
  steplog same A.jsonl "RP$z.jsonl" 5 8 1e-5
done
for z in 1 2; do
  train "T$z" 4 --train.steps=8 --parallel.tp=2 --parallel.zero="$z" \
    --ckpt.resume="$WORK/G/step-4.h5" --ckpt.dir="N2$z" --train.log-file="T$z.jsonl"
  expect_rc "T$z" 0
  steplog same A.jsonl "T$z.jsonl" 5 8 1e-5
done

# Encrypted and in the background: the snapshot holds each rank's range, the writer thread seals.
train X 2 --train.steps=8 --parallel.zero=2 --ckpt.dir=K --ckpt.every=4 --ckpt.async=true \
  --ckpt.encrypt=true --security.key_file=key.bin
expect_rc X 0
expect_file K/step-4.h5
"$DT_CKPT" verify K/step-4.h5 --security.key_file key.bin >verify_k.out 2>&1 ||
  fail "dt_ckpt verify K/step-4.h5 with the key: $(cat verify_k.out)"
train RX 1 --train.steps=8 --ckpt.resume="$WORK/K/step-4.h5" --ckpt.dir=L --ckpt.encrypt=true \
  --security.key_file=key.bin --train.log-file=RX.jsonl
expect_rc RX 0
expect_line RX "resumed from .*K/step-4\.h5 at step 4 "
steplog same A.jsonl RX.jsonl 5 8 1e-5
finish
