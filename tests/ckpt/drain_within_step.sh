#!/usr/bin/env bash
# ckpt.drain_within_step{,_fp16,_zero1,_zero2,_zero3,_graphs,_tp2,_pp2,_pp2_dp2_zero3} (MODE plain,
# fp16, zero1-3: ZeRO stages, graphs: engine.cuda_graphs, tp2: tensor parallelism on the stage
# engine, pp2: two pipeline stages, pp2_dp2_zero3: two stages of two data-parallel ZeRO-3 ranks on
# 4 ranks): a run whose steps have M micro-batches a rank (500; pp2: 1000) gets SIGUSR1 on rank 1
# during step S (2, or 3 on a loaded machine). The ranks give the step up at a micro-batch
# boundary: "step S given up after K of its M micro-batches" (0 < K < M; the pipeline: K is the
# boundary rank 1 said, where the vote it took is read), "drained at step S-1", exit 75, step-(S-1).h5 committed,
# and the step log holds steps 1..S-1 only. The requeued run resumes from it and trains steps
# S..3 as the uninterrupted run did (losses within 1e-5; fp16: the same loss scales), so nothing
# of the given-up step (gradients, loss scale, optimizer state, data position) was kept.
source "$(dirname "$0")/lib.sh"

BATCH=4000 RANKS=2 PIPELINE=0 M=500
case "$MODE" in
  plain) EXTRA=() ;;
  fp16) EXTRA=(--train.dtype=fp16) ;;
  zero1) EXTRA=(--parallel.zero=1) ;;  # the optimizer state sharded: a sharded checkpoint
  # Gradients (and ZeRO-3: parameters) sharded: every micro-batch's gradients are being reduced
  # at the boundary.
  zero2) EXTRA=(--parallel.zero=2) ;;
  zero3) EXTRA=(--parallel.zero=3) ;;
  graphs) EXTRA=(--engine.cuda_graphs=true) ;;  # micro-batches replayed from a graph
  # The stage engine, tensor parallel: one pipeline stage, and one data-parallel rank with the
  # whole batch.
  tp2) EXTRA=(--parallel.tp=2) BATCH=2000 ;;
  # Two pipeline stages, micro-batches in flight between them; one data-parallel rank with the
  # whole batch, in twice as many micro-batches: the last votes are 3 micro-batches before a
  # step's end, and a step should outlast the signal's delay.
  pp2) EXTRA=(--parallel.pp=2) PIPELINE=1 M=1000 ;;
  pp2_dp2_zero3) EXTRA=(--parallel.pp=2 --parallel.zero=3) RANKS=4 PIPELINE=1 ;;
  *) echo "unknown mode '$MODE'"; exit 2 ;;
esac
# 4000 sequences a step, 2000 a data-parallel rank, in micro-batches of 4: 500 a rank (tp2: 2000
# sequences, one data-parallel rank; pp2: 4000 on one).
OPTS=(--train.batch=$BATCH --train.micro-batch=4 --train.eval-every=0 --train.log-every=1
      "${EXTRA[@]}")

train U "$RANKS" --train.steps=3 --train.log-file=U.jsonl "${OPTS[@]}"
expect_rc U 0
steplog steps U.jsonl 1 3

echo "=== L: $RANKS ranks in the background: dt_train --train.steps=3 --ckpt.dir=D"
timeout -k 10 "$RUN_LIMIT" "${MPIEXEC[@]}" -n "$RANKS" "$BIN" --config "$CONFIG" --data.path="$TEXT" \
  --train.steps=3 --ckpt.dir="$WORK/D" --train.log-file="$WORK/L.jsonl" "${OPTS[@]}" \
  >L.out 2>&1 &
job=$!
# The signal goes 0.3 s after step 1 is logged: past the drain check before step 2, during step 2
# (a step takes about 0.6 s) or, on a loaded machine, step 3. The step S it comes in is read from
# the output.
for _ in $(seq 1200); do
  [ -s L.jsonl ] && break
  kill -0 "$job" 2>/dev/null || break
  sleep 0.05
done
[ -s L.jsonl ] || fail "the run logged no step"
sleep 0.3
pid=$(rank_pid_of "--train\.log-file=$WORK/L\.jsonl( |\$)" 1)
if [ -z "$pid" ]; then
  fail "no process of rank 1 found"
  kill -TERM "$job" 2>/dev/null
else
  echo "sending SIGUSR1 to rank 1 (pid $pid)"
  kill -USR1 "$pid"
fi
wait "$job"
RC=$?
sed 's/^/    /' L.out
echo "=== L: exit code $RC"
expect_rc L 75
given=$(sed -nE "s/^dt_train: step ([0-9]+) given up after ([0-9]+) of its $M micro-batches, for a drain: nothing of it is kept, and the run drains as of step ([0-9]+)\$/\1 \2 \3/p" L.out)
read -r S K P <<<"$given"
if [ -z "$given" ]; then
  fail "L: no line saying a step was given up"
  S=2 K=0 P=1
fi
[ "$S" -ge 2 ] && [ "$S" -le 3 ] || fail "L: step $S given up, expected step 2 or 3 (the signal came after step 1)"
[ "$P" -eq $((S - 1)) ] || fail "L: step $S given up, drained as of step $P"
[ "$K" -gt 0 ] && [ "$K" -lt "$M" ] || fail "L: step $S given up after $K micro-batches, expected between 1 and $((M - 1))"
if [ "$PIPELINE" = 1 ]; then
  # Rank 1 took its vote before micro-batch k's forward (0-based); every rank reads it before
  # micro-batch k+2's (pp = 2): after k+2 micro-batches, the N it said.
  said=$(sed -nE "s/^dt_train: rank 1: drain signal during step $S: the step is given up when the pipeline's vote is read, after at most ([0-9]+) of its micro-batches$/\1/p" L.out)
  [ -n "$said" ] || fail "L: rank 1 did not say the pipeline's vote would give step $S up"
  [ "${said:-0}" -eq "$K" ] || fail "L: rank 1 said the step is given up after at most $said micro-batches, it was after $K"
else
  expect_line L "^dt_train: rank 1: drain signal during step $S: the step is given up at this micro-batch boundary$"
fi
expect_no_line L "^dt_train: rank [^1]: drain signal"
expect_line L "^dt_train: drained at step $P \(checkpoint in .*/D\), exit code 75$"
expect_no_line L "^step +$S/3"
steplog steps L.jsonl 1 "$P"
expect_latest D "step-$P.h5"
[ "$(files_in D)" = "latest step-$P.h5" ] || fail "files in D: $(files_in D)"

resumes_like_uninterrupted "$P" 3 "${OPTS[@]}"
finish
