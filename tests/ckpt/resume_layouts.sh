#!/usr/bin/env bash
# parallel.ckpt_across_layouts: checkpoints stay global under tensor and pipeline parallelism. A
# checkpoint written by dp=1 tp=2 pp=2 (shards assembled into global datasets) resumes on one rank
# (the fused model) and on dp=2 pp=2, and both continue a single-rank run that never stopped
# (losses, learning rates and final validation loss within 1e-5 relative); a background save
# from the same layout writes the same tensors.
source "$(dirname "$0")/lib.sh"

train A 1 --train.steps=8 --train.log-file=A.jsonl
expect_rc A 0
train B 4 --train.steps=8 --parallel.tp=2 --parallel.pp=2 --ckpt.dir=D --ckpt.every=4 \
  --train.log-file=B.jsonl
expect_rc B 0
expect_file D/step-4.h5
steplog same A.jsonl B.jsonl 1 8 1e-5

train R1 1 --train.steps=8 --ckpt.resume="$WORK/D/step-4.h5" --ckpt.dir=E1 \
  --train.log-file=R1.jsonl
expect_rc R1 0
expect_line R1 "resumed from .*D/step-4\.h5 at step 4 "
expect_line R1 "written by dp=1 tp=2 pp=2"
steplog steps R1.jsonl 5 8
steplog same A.jsonl R1.jsonl 5 8 1e-5

train R4 4 --train.steps=8 --parallel.pp=2 --ckpt.resume="$WORK/D/step-4.h5" --ckpt.dir=E4 \
  --train.log-file=R4.jsonl
expect_rc R4 0
expect_line R4 "layout dp=2 tp=1 pp=2$"
steplog steps R4.jsonl 5 8
steplog same A.jsonl R4.jsonl 5 8 1e-5

# The background writer gets the assembled state too: same datasets as the blocking save.
train C 4 --train.steps=8 --parallel.tp=2 --parallel.pp=2 --ckpt.dir=F --ckpt.every=4 \
  --ckpt.async=true
expect_rc C 0
expect_file F/step-4.h5
# h5dump: hdf5-tools, which scripts/bootstrap installs. A failing h5dump fails its pipeline.
if ! command -v h5dump >/dev/null; then
  fail "h5dump is missing (install hdf5-tools): cannot compare the files"
  finish
fi
set -o pipefail
for f in step-4.h5 step-8.h5; do
  [ -f "D/$f" ] && [ -f "F/$f" ] || { fail "D/$f or F/$f is missing"; continue; }
  a=$(h5dump -g /checksums "D/$f" | tail -n +2 | md5sum) || { fail "h5dump D/$f failed"; continue; }
  b=$(h5dump -g /checksums "F/$f" | tail -n +2 | md5sum) || { fail "h5dump F/$f failed"; continue; }
  [ "$a" = "$b" ] || fail "$f: the background save wrote other tensors than the blocking one"
done
finish
