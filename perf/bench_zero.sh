#!/usr/bin/env bash
# Sharded data parallelism (parallel.zero): model-state bytes per rank at each stage against the
# ZeRO paper's formulas, the measured peak resident memory, and the step time against zero=0, in
# one run.
#   perf/bench_zero.sh [BUILD_DIR]
# The model: 8 layers, embd 256, seq 32, vocab 256 (6.4 M parameters P), global batch 8 in
# micro-batches of 1, fp32 training. dt keeps fp32 parameters and gradients (4 bytes each; bf16
# and fp16 values are stored in fp32 too), so its formulas are the paper's with 4-byte parameters
# and gradients: 16P, 8P + 16P/N (full parameters and gradients; master, moments and the reduced
# gradient slice sharded), 4P + 16P/N, 16P/N, plus the gather and reduce buffers of one to three
# units. The paper (mixed precision, 2-byte parameters and gradients, 12 bytes of fp32 optimizer
# state): 16P, 4P + 12P/N, 2P + 14P/N, 16P/N. Step time: steady-state tokens/s of the run, as a
# ratio to zero=0 at the same N (zero=0 reduces through the shared-memory all-reduce; zero>=1
# through MPI reduce-scatter and all-gather).
set -euo pipefail
build=${1:-${DT_BUILD_DIR:-$(dirname "$0")/../build}}
root=$(cd "$(dirname "$0")/.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_mpi_yield_when_idle=1
[ -f "$root/run/corpus.txt" ] || "$root/scripts/corpus" >/dev/null
echo "load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
mib() {  # "12.5 MiB" -> MiB
  awk -v n="$1" -v u="$2" 'BEGIN { m = 1; if (u == "KiB") m = 1 / 1024; if (u == "GiB") m = 1024;
    if (u == "B") m = 1 / 1048576; printf "%.1f\n", n * m }'
}
printf '| layout | N | zero | dt model state (MiB) | dt formula (MiB) | paper formula (MiB) | peak RSS max (MiB) | tok/s | speed vs zero=0 |\n'
printf '|---|---|------|------|------|------|------|------|------|\n'
# Layouts: N data-parallel ranks alone (the fused model), and dp=2 with 2 pipeline stages (the
# graph engine, 4 ranks; the state is rank 0's: the first stage, whose Ps parameters are its
# zero=0 state / 16, stand in for P in the formulas).
for layout in dp2 dp4 dp2-pp2; do
  case $layout in
    dp2) N=2 ranks=2 extra=() ;;
    dp4) N=4 ranks=4 extra=() ;;
    dp2-pp2) N=2 ranks=4 extra=(--parallel.pp=2) ;;
  esac
  base= Ps=
  for z in 0 1 2 3; do
    cmd=(mpiexec -n "$ranks" "$build/apps/dt_train" --config "$root/configs/micro.ini"
         --data.path="$root/run/corpus.txt" --model.layers=8 --model.embd=256 --model.heads=4
         --train.batch=8 --train.micro-batch=1 --train.steps=8 --train.eval-every=0
         --train.eval-windows=2 --train.log-every=1000 --parallel.zero="$z" "${extra[@]}")
    out=$("${cmd[@]}" 2>&1)
    P=$(sed -nE 's/^dt_train: ([0-9]+) parameters.*/\1/p' <<<"$out")
    read -r sn su < <(sed -nE 's/.*model state ([0-9.]+) ([KMG]?i?B);.*/\1 \2/p' <<<"$out")
    read -r pn pu < <(sed -nE 's/.*; max ([0-9.]+) ([KMG]?i?B).*/\1 \2/p' <<<"$out")
    tps=$(sed -nE 's/.* ([0-9]+) tok\/s \(steady state\).*/\1/p' <<<"$out")
    [ -z "$base" ] && base=$tps
    [ -z "$Ps" ] && Ps=$(awk -v m="$(mib "$sn" "$su")" -v P="$P" -v l="$layout" \
      'BEGIN { if (l == "dp2-pp2") printf "%.0f\n", m * 1048576 / 16; else print P }')
    read -r mine paper < <(awk -v P="$Ps" -v N="$N" -v z="$z" 'BEGIN {
      f[0] = 16 * P; f[1] = 8 * P + 16 * P / N; f[2] = 4 * P + 16 * P / N; f[3] = 16 * P / N;
      g[0] = 16 * P; g[1] = 4 * P + 12 * P / N; g[2] = 2 * P + 14 * P / N; g[3] = 16 * P / N;
      printf "%.1f %.1f\n", f[z] / 1048576, g[z] / 1048576 }')
    printf '| %s | %s | %s | %s | %s | %s | %s | %s | %.2fx |\n' "$layout" "$N" "$z" \
      "$(mib "$sn" "$su")" "$mine" "$paper" "$(mib "$pn" "$pu")" "$tps" \
      "$(awk -v a="$tps" -v b="$base" 'BEGIN { print a / b }')"
  done
done
echo "P = $P parameters"
echo "command: ${cmd[*]} (ranks, parallel.pp and parallel.zero varied)"
