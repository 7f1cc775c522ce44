#!/usr/bin/env bash
# Checkpoint write/read bandwidth of a 1 GiB state on 1, 2 and 4 ranks, side by side with dd
# (with fdatasync) writing the same amount to the same file system, and the blocking time of an
# asynchronous save against the synchronous save. Appends the table to perf/RESULTS.md.
#   perf/bench_ckpt.sh [REPS] [MIB]     (default 2 reps of 1024 MiB; the best of the reps)
# As root, the page cache is dropped before each read so reads come from the disk.
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
reps=${1:-2}
mib=${2:-1024}
dt_bench_build
dir=${DT_BENCH_DIR:-$DT_ROOT/run/bench-ckpt}
mkdir -p "$dir"
drop=""
[ "$(id -u)" -eq 0 ] && drop="-x DT_BENCH_DROP_CACHES=1"
export DT_BENCH_DROP_CACHES=1

best() { sort -g | tail -1; }
rows=()
for ranks in 1 2 4; do
  ddr=() wr=() rd=() blk=()
  for _ in $(seq "$reps"); do
    rm -rf "$dir"/*
    s=$(dd if=/dev/zero of="$dir/dd.bin" bs=16M count=$((mib / 16)) conv=fdatasync 2>&1 |
        sed -nE 's/.* copied, ([0-9.]+) s.*/\1/p')
    rm -f "$dir/dd.bin"
    ddr+=("$(awk -v m="$mib" -v s="$s" 'BEGIN{printf "%.3f", m / 1024 * 1.073741824 / s}')")
    line=$(mpiexec -n "$ranks" $drop "$build/perf/bench_ckpt" "$dir" "$mib")
    read -r _ _ _ bytes _ save _ load _ block _ <<<"$line"
    wr+=("$(awk -v b="$bytes" -v s="$save" 'BEGIN{printf "%.3f", b / s / 1e9}')")
    rd+=("$(awk -v b="$bytes" -v s="$load" 'BEGIN{printf "%.3f", b / s / 1e9}')")
    blk+=("$(awk -v a="$block" -v s="$save" 'BEGIN{printf "%.4f", a / s}')")
  done
  d=$(printf '%s\n' "${ddr[@]}" | best)
  w=$(printf '%s\n' "${wr[@]}" | best)
  r=$(printf '%s\n' "${rd[@]}" | best)
  b=$(printf '%s\n' "${blk[@]}" | sort -g | head -1)
  rows+=("| $ranks | $d | $w | $(awk -v w="$w" -v d="$d" 'BEGIN{printf "%.2f", w / d}') | $r | $(awk -v b="$b" 'BEGIN{printf "%.1f%%", b * 100}') | dd: ${ddr[*]}; dt write: ${wr[*]} |")
done
rm -rf "$dir"
table=$( {
  echo "| ranks | dd write GB/s | dt save GB/s | dt/dd | dt load GB/s (cold cache, verified) | async blocking / sync save | all reps |"
  echo "|---:|---:|---:|---:|---:|---:|---|"
  printf '%s\n' "${rows[@]}"
} )
echo "$table"
{
  echo
  echo "## Checkpoint I/O, $mib MiB state, $(date -u +%Y-%m-%d), $(nproc) cores ($(uname -n)), $(df -h "$DT_ROOT" | awk 'NR==2{print $1}')"
  echo
  echo "Command: \`perf/bench_ckpt.sh $reps $mib\` (best of $reps; dd and dt alternate on the same file system; a save includes SHA-256 of every chunk, fsync and the atomic commit)"
  echo
  echo "$table"
} >> "$DT_ROOT/perf/RESULTS.md"
