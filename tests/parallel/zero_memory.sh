#!/usr/bin/env bash
# zero_memory.sh WORKDIR DT_TRAIN CONFIG TEXT MPIEXEC...
# parallel.zero.memory: the measured peak resident memory of every rank (getrusage, printed by
# dt_train at the end) falls as the ZeRO stage rises, on 4 ranks with a model whose state (16
# bytes per parameter, 6.4 M parameters) outweighs everything else. Each run also prints its
# per-rank memory report at the start, which equals the plan's estimate (--print-plan), and
# mem.limit judges a layout by that estimate: a limit between the zero=3 and the zero=0 estimates
# refuses zero=0 before training and lets zero=3 run. In bf16 the estimate counts the fp32 master
# copy, the weights' 16-bit copy (zero 0-2) and the bf16 gradient wire (train.grad-reduce=bf16) as
# the report does, and at zero=0 the parameters grow over fp32's by the copy's logged size.
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
# "... parameters A, gradients B, optimizer state C, ..." -> "A|B|C"
state() { sed -nE "s/.*$1[^(]*\(?parameters ([^,]*), gradients ([^,]*), optimizer state ([^,;]*)[,;].*/\1|\2|\3/p" "$2" | head -1; }
run() {
  timeout -k 5 300 "${MPIEXEC[@]}" -n 4 "$BIN" --config "$CONFIG" --data.path="$TEXT" \
    --model.layers=8 --model.embd=256 --model.heads=4 --train.batch=4 --train.steps=2 \
    --train.eval-windows=4 "$@"
}
prev=
for z in 0 1 2 3; do
  run --parallel.zero=$z --print-plan >"p$z.out" 2>&1 || { cat "p$z.out"; FAIL "zero=$z: --print-plan failed"; }
  run --parallel.zero=$z >"z$z.out" 2>&1
  rc=$?
  est=$(state "estimated memory per rank" "p$z.out") got=$(state "memory per rank .parallel.zero=$z, rank 0.:" "z$z.out")
  echo "zero=$z: plan estimate $est, report $got"
  [ -n "$est" ] && [ "$est" = "$got" ] || FAIL "zero=$z: the plan's estimate '$est' differs from the report '$got'"
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
# bf16: the fp32 master copy, the weights' 16-bit copy and the gradient wire are counted by the
# plan as by the report.
for c in 0 1 2 0w; do
  z=${c%w} wire=
  [ "$c" = 0w ] && wire=--train.grad-reduce=bf16
  run --parallel.zero=$z --train.dtype=bf16 $wire --print-plan >"b$c.plan" 2>&1 ||
    { cat "b$c.plan"; FAIL "bf16 zero=$z $wire: --print-plan failed"; }
  run --parallel.zero=$z --train.dtype=bf16 $wire >"b$c.out" 2>&1 ||
    { cat "b$c.out"; FAIL "bf16 zero=$z $wire: the run failed"; }
  est=$(state "estimated memory per rank" "b$c.plan") got=$(state "memory per rank .parallel.zero=$z, rank 0.:" "b$c.out")
  echo "bf16 zero=$z $wire: plan estimate $est, report $got"
  [ -n "$est" ] && [ "$est" = "$got" ] ||
    FAIL "bf16 zero=$z $wire: the plan's estimate '$est' differs from the report '$got'"
  [ "$est" != "$(state "estimated memory per rank" "p$z.out")" ] ||
    FAIL "bf16 zero=$z $wire: the estimate equals fp32's (no master copy counted)"
done
[ "$(state "estimated memory per rank" b0w.plan)" != "$(state "estimated memory per rank" b0.plan)" ] ||
  FAIL "bf16 zero=0: the estimate with the bf16 gradient wire equals the one without"
# The copy the run allocated ("... copy of the weights (12.2 MiB, ...") is what the report adds to
# fp32's parameters (figures to 0.1 of their unit).
read -r cn cu < <(sed -nE 's/.*copy of the weights \(([0-9.]+) ([KMG]?i?B),.*/\1 \2/p' b0.out)
read -r pn pu < <(state "memory per rank .parallel.zero=0, rank 0.:" z0.out | cut -d'|' -f1 | tr ' ' '\n' | paste -sd' ')
read -r bn bu < <(state "memory per rank .parallel.zero=0, rank 0.:" b0.out | cut -d'|' -f1 | tr ' ' '\n' | paste -sd' ')
if [ -z "$cn" ] || [ -z "$pn" ] || [ -z "$bn" ]; then
  FAIL "bf16 zero=0: no copy size ('$cn $cu') or parameter figures ('$pn $pu', '$bn $bu')"
else
  awk -v c="$(bytes "$cn" "$cu")" -v d="$(($(bytes "$bn" "$bu") - $(bytes "$pn" "$pu")))" \
    'BEGIN { exit !(c - d <= 0.15 * 1048576 && d - c <= 0.15 * 1048576) }' ||
    FAIL "bf16 zero=0: the copy ($cn $cu) is not what the report adds to fp32's parameters ($pn $pu -> $bn $bu)"
  echo "bf16 zero=0: copy $cn $cu; parameters $pn $pu (fp32) -> $bn $bu (bf16)"
fi
total() {
  read -r n u < <(sed -nE 's/.*estimated memory per rank ([0-9.]+) ([KMG]?i?B) .*/\1 \2/p' "$1" | head -1)
  bytes "$n" "$u"
}
limit=$((($(total p0.out) + $(total p3.out)) / 2))
run --parallel.zero=0 --mem.limit="$limit" >l0.out 2>&1 && FAIL "zero=0 ran over --mem.limit=$limit"
grep -q "over --mem.limit" l0.out || { cat l0.out; FAIL "zero=0: no refusal naming --mem.limit"; }
run --parallel.zero=3 --mem.limit="$limit" >l3.out 2>&1 ||
  { cat l3.out; FAIL "zero=3 refused under --mem.limit=$limit"; }
[ "$fail" -eq 0 ] && echo "zero_memory.sh: PASS" || echo "zero_memory.sh: FAIL"
exit "$fail"
