#!/usr/bin/env bash
# train.fp32_inf_gradient.*: fp32 has no loss scaler, so a non-finite gradient (the seam
# --test.inject-inf-rank=1 at step 4) ends the run at that step on every rank, whatever the
# layout: exit 3 with "gradient norm is inf at step 4 ... the weights stay as they were after step
# 3", no rank finishes step 4 (no progress line of it), and no checkpoint of it is written
# (--ckpt.every=1: step-3.h5 stays the newest).
#   fp32_inf.sh WORKDIR MPIEXEC RANKS DT_TRAIN ARGS...
set -u
WORK=$1 MPIEXEC=$2 RANKS=$3
shift 3
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
rm -rf "$WORK"
mkdir -p "$WORK"
out=$("$MPIEXEC" -n "$RANKS" "$@" --train.steps=6 --train.log-every=1 --train.eval-every=0 \
      --test.inject-inf-rank=1 --test.inject-inf-step=3 --ckpt.dir="$WORK/ck" --ckpt.every=1 2>&1)
rc=$?
echo "$out" | grep -E "^step|error|ckpt: saved"
[ $rc -eq 3 ] || fail "exit code $rc, expected 3"
echo "$out" | grep -qE "gradient norm is (inf|nan) at step 4 .*the weights stay as they were after step 3" ||
  fail "no 'gradient norm is inf at step 4' error"
echo "$out" | grep -qE "^step +3/6" || fail "step 3 was not trained"
echo "$out" | grep -qE "^step +4/6" && fail "a rank finished step 4 with an Inf in its gradients"
[ -e "$WORK/ck/step-3.h5" ] || fail "no step-3.h5: $(ls "$WORK/ck" 2>&1)"
[ -e "$WORK/ck/step-4.h5" ] && fail "step-4.h5 was written after the Inf"
[ $FAILED -eq 0 ] && { echo "fp32_inf.sh: PASS"; rm -rf "$WORK"; exit 0; }
echo "fp32_inf.sh: FAIL"
exit 1
