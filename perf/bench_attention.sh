#!/usr/bin/env bash
# model.attention=flash (one log-sum-exp per query row kept, the probabilities recomputed in the
# backward) against model.attention=full (the T x T probabilities kept) on the CPU device, side by
# side in one run: training tokens/s, the activation memory dt_train reports, and the peak
# resident memory, at growing sequence lengths.
#   perf/bench_attention.sh [BUILD_DIR] [ROUNDS]      (default build/, 3 rounds)
# The model: gpt-tiny (4 layers, 4 heads of 64, embd 256, byte tokens), one rank, batch 4 in one
# micro-batch, fp32, 6 steps (steady-state tok/s from dt_train's own "done" line). Each round runs
# full then flash at every length; the speed ratio is flash / full within a round, given as the
# median (min-max) over the rounds.
set -euo pipefail
build=${1:-${DT_BUILD_DIR:-$(dirname "$0")/../build}}
rounds=${2:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$root/run/corpus.txt" ] || "$root/scripts/corpus" >/dev/null
echo "load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
run() {  # SEQ ATTENTION -> "tok/s activations peak"
  local out
  out=$("$build/apps/dt_train" --config "$root/configs/gpt-tiny.ini" \
    --data.path="$root/run/corpus.txt" --model.seq-len="$1" --model.attention="$2" \
    --train.batch=4 --train.micro-batch=4 --train.steps=6 --train.eval-every=0 \
    --train.eval-windows=1 --train.log-every=1000 2>&1) || {
    echo "bench_attention: dt_train at seq $1 with model.attention=$2 failed:" >&2
    tail -5 <<<"$out" >&2
    exit 1
  }
  local tps act peak
  tps=$(sed -nE 's/.* ([0-9]+) tok\/s \(steady state\).*/\1/p' <<<"$out")
  act=$(sed -nE 's/.*; activations ([0-9.]+ [KMG]?i?B).*/\1/p' <<<"$out")
  peak=$(sed -nE 's/.*peak resident memory per rank: ([0-9.]+ [KMG]?i?B).*/\1/p' <<<"$out")
  echo "$tps|$act|$peak"
}
seqs=(256 512 1024 2048)
declare -A tps_full tps_flash mem
for ((r = 1; r <= rounds; ++r)); do
  for s in "${seqs[@]}"; do
    IFS='|' read -r t a p < <(run "$s" full)
    tps_full[$s]+="$t "
    mem[$s,full]="$a|$p"
    IFS='|' read -r t a p < <(run "$s" flash)
    tps_flash[$s]+="$t "
    mem[$s,flash]="$a|$p"
  done
done
printf '| seq | full tok/s | flash tok/s | flash / full (median, min-max) | activations full | activations flash | peak RSS full | peak RSS flash |\n'
printf '|---|---|---|---|---|---|---|---|\n'
for s in "${seqs[@]}"; do
  read -r ratio lo hi fu fl < <(python3 -c '
import statistics, sys
a = [float(x) for x in sys.argv[1].split()]
b = [float(x) for x in sys.argv[2].split()]
q = [y / x for x, y in zip(a, b)]
print("%.2f %.2f %.2f %d %d" % (statistics.median(q), min(q), max(q), statistics.median(a),
                                statistics.median(b)))' "${tps_full[$s]}" "${tps_flash[$s]}")
  IFS='|' read -r afu pfu <<<"${mem[$s,full]}"
  IFS='|' read -r afl pfl <<<"${mem[$s,flash]}"
  printf '| %s | %s | %s | %sx (%s-%s) | %s | %s | %s | %s |\n' "$s" "$fu" "$fl" "$ratio" "$lo" "$hi" \
    "$afu" "$afl" "$pfu" "$pfl"
done
echo "command: $build/apps/dt_train --config configs/gpt-tiny.ini --data.path=run/corpus.txt" \
  "--model.seq-len=S --model.attention=full|flash --train.batch=4 --train.micro-batch=4" \
  "--train.steps=6 --train.eval-every=0 --train.eval-windows=1 --train.log-every=1000" \
  "($rounds rounds)"
