#!/usr/bin/env bash
# zero_memory.sh WORKDIR DT_TRAIN CONFIG TEXT MPIEXEC...
# parallel.zero.memory: the measured peak resident memory of every rank (getrusage, printed by
# dt_train at the end) falls as the ZeRO stage rises, on 4 ranks with a model whose state (16
# bytes per parameter, 6.4 M parameters) outweighs everything else. Each run also prints its
# per-rank memory report at the start.
set -u
WORK=$1 BIN=$2 CONFIG=$3 TEXT=$4
shift 4
MPIEXEC=("$@")
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
trap 'cd /; rm -rf "$WORK"' EXIT
fail=0
FAIL() { echo "FAIL: $*"; fail=1; }
# bytes "12.5 MiB" -> integer bytes
bytes() {
  awk -v n="$1" -v u="$2" 'BEGIN { m = 1; if (u == "KiB") m = 1024; if (u == "MiB") m = 1048576;
    if (u == "GiB") m = 1073741824; printf "%.0f\n", n * m }'
}
prev=
for z in 0 1 2 3; do
  timeout -k 5 300 "${MPIEXEC[@]}" -n 4 "$BIN" --config "$CONFIG" --data.path="$TEXT" \
    --model.layers=8 --model.embd=256 --model.heads=4 --train.batch=4 --train.steps=2 \
    --train.eval-windows=4 --parallel.zero=$z >"z$z.out" 2>&1
  rc=$?
  grep -E "memory" "z$z.out"
  [ "$rc" -eq 0 ] || { cat "z$z.out"; FAIL "zero=$z: exit code $rc"; continue; }
  grep -q "memory per rank (parallel.zero=$z, rank 0): parameters" "z$z.out" ||
    FAIL "zero=$z: no memory report at the start"
  line=$(grep -E "peak resident memory per rank:" "z$z.out")
  [ "$(grep -o '(rank [0-9]*)' <<<"$line" | wc -l)" -eq 4 ] || FAIL "zero=$z: not every rank's peak"
  read -r num unit < <(sed -E 's/.*; max ([0-9.]+) ([KMG]?i?B).*/\1 \2/' <<<"$line")
  peak=$(bytes "$num" "$unit")
  echo "zero=$z: peak $num $unit ($peak bytes)"
  if [ -n "$prev" ] && [ "$peak" -ge "$prev" ]; then
    FAIL "zero=$z: peak $peak bytes is not below zero=$((z - 1))'s $prev bytes"
  fi
  prev=$peak
done
[ "$fail" -eq 0 ] && echo "zero_memory.sh: PASS" || echo "zero_memory.sh: FAIL"
exit "$fail"
