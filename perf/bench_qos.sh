#!/usr/bin/env bash
# QoS tiers against no tier, side by side in one run: dt_train (micro config, 2 ranks) as Slurm
# jobs of the local cluster (scripts/slurm-local, with dt's prolog and epilog), one job per variant
# in each of ROUNDS rounds (default 3), the order of the variants rotating from round to round:
#   none         --comment=dt-qos=best_effort and --qos.file=none: the prolog makes the tier's
#                groups, dt_train leaves its ranks and threads where Slurm started them
#   realtime, high, best_effort
#                --comment=dt-qos=TIER: dt_train moves its ranks into the tier's groups and gives
#                its communication progress thread SCHED_FIFO at the tier's priority
# Each job prints its steady-state tokens/s ("dt_train: done: ... tok/s (steady state)"); the
# table gives, per variant, the median (min-max) over the rounds and the median of the per-round
# ratio to `none` of the same build.
#   perf/bench_qos.sh [BUILD_DIR] [BASELINE_BUILD_DIR]
# With BASELINE_BUILD_DIR (another dt's build, e.g. the previous implementation) every round also
# runs each variant with its dt_train, rows "base: VARIANT".
# NODES=2: a cluster of two namespaced nodes (scripts/slurm-local up --nodes 2), one rank each, so
# that the gradient all-reduce crosses nodes through MPI (TCP over a veth bridge). STEPS (default
# 3000) training steps per job; ARGS: more dt_train options. RANKS (default 2) ranks per job,
# spread evenly over the nodes: NODES=2 RANKS=4 puts 2 ranks on each node, 4 ranks on this
# machine's 2 cores, as the multi-node Slurm tests do (Open MPI does not know they oversubscribe
# the cores). LIMIT (default 300) seconds per job: a job still running then is cancelled and its
# cell reads "> LIMIT s" (the round's ratios for it are left out). Needs root. Uses a cluster that is
# already up with that many nodes; otherwise brings one up and takes it down at the end (a
# cluster with another node count is taken down first).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-${DT_BUILD_DIR:-$root/build}}" && pwd)
baseline=${2:+$(cd "$2" && pwd)}
rounds=${ROUNDS:-3}
nodes=${NODES:-1}
steps=${STEPS:-3000}
ranks=${RANKS:-2}
limit=${LIMIT:-300}
extra=(${ARGS:-})
for b in "$build" $baseline; do
  [ -x "$b/apps/dt_train" ] || { echo "bench_qos.sh: no $b/apps/dt_train (build first)" >&2; exit 2; }
done
case $nodes in 1 | 2) ;; *) echo "bench_qos.sh: NODES must be 1 or 2" >&2; exit 2 ;; esac
[ $((ranks % nodes)) = 0 ] && [ "$ranks" -ge "$nodes" ] ||
  { echo "bench_qos.sh: RANKS ($ranks) must be a multiple of NODES ($nodes)" >&2; exit 2; }

slurm=$root/scripts/slurm-local
count_nodes() { "$slurm" nodes 2>/dev/null | grep -c . || true; }
started=0
if "$slurm" status >/dev/null 2>&1; then
  have=$(count_nodes)
  [ "$nodes" = 1 ] && [ "$have" -le 1 ] || [ "$have" = "$nodes" ] || { "$slurm" down >/dev/null; }
fi
if ! "$slurm" status >/dev/null 2>&1; then
  if [ "$nodes" = 2 ]; then "$slurm" up --nodes 2 >/dev/null; else "$slurm" up >/dev/null; fi
  started=1
fi
eval "$("$slurm" env)"
export SLURM_CONF
work=$(mktemp -d /tmp/dt-bench-qos.XXXXXX)
chmod 755 "$work"
cleanup() {
  local j
  for j in $(cat "$work/jobs" 2>/dev/null); do scancel "$j" 2>/dev/null || true; done
  rm -rf "$work"
  [ "$started" = 0 ] || "$slurm" down >/dev/null 2>&1 || true
}
trap cleanup EXIT
text=/usr/share/common-licenses/GPL-3
cp "$text" "$work/text"

# run [base:]VARIANT: one job (base: with the baseline's dt_train); prints its steady-state
# tokens/s, or "> LIMIT s" when it was cancelled at the limit.
run() {
  local v=${1#base:} bin=$build/apps comment=best_effort qos=() job s out
  [ "$1" = "$v" ] || bin=$baseline/apps
  [ "$v" = none ] && qos=(--qos.file=none) || comment=$v
  out=$work/$v.$RANDOM.out
  job=$(cd "$work" && sbatch --parsable -N "$nodes" --ntasks-per-node=$((ranks / nodes)) \
    --comment=dt-qos="$comment" -o "$out" --export=ALL,DT_BIN="$bin" \
    "$root/slurm/train.sbatch" "$root/configs/micro.ini" --data.path="$work/text" \
    --train.steps="$steps" --train.log-every=100000 --train.eval-every=0 "${qos[@]}" "${extra[@]}")
  job=${job%%;*}
  echo "$job" >>"$work/jobs"
  local t0=$SECONDS
  while :; do
    s=$(scontrol show job -o "$job" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')
    case "$s" in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) break ;; esac
    if [ $((SECONDS - t0)) -ge "$limit" ]; then
      scancel "$job"
      while scontrol show job -o "$job" 2>/dev/null | grep -Eq "JobState=(RUNNING|COMPLETING)"; do
        sleep 1
      done
      echo "  $1: job $job cancelled after $limit s; its last step line: $(grep '^step' "$out" | tail -n1)" >&2
      echo "> $limit s"
      return 0
    fi
    sleep 1
  done
  local tps
  tps=$(sed -nE 's/^dt_train: done: .* ([0-9]+) tok\/s \(steady state\).*/\1/p' "$out" | tail -n1)
  if [ "$s" != COMPLETED ] || [ -z "$tps" ]; then
    echo "bench_qos.sh: job $job ($v) ended $s without a rate; its output:" >&2
    sed 's/^/    /' "$out" >&2
    exit 1
  fi
  tier=$(sed -nE 's/^dt_train: qos: (.*)/\1/p' "$out" | head -n1)
  [ -n "$tier" ] && echo "  $1: $tier" >&2
  echo "$tps"
}

variants=(none realtime high best_effort)
[ -z "$baseline" ] || variants+=(base:none base:realtime base:high base:best_effort)
declare -A rate
echo "load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores, $nodes node(s), $ranks ranks, $steps steps"
for ((r = 0; r < rounds; r++)); do
  order=()
  for ((i = 0; i < ${#variants[@]}; i++)); do order+=("${variants[$(((i + r) % ${#variants[@]}))]}"); done
  line="round $((r + 1)) (load $(cut -d' ' -f1 /proc/loadavg)):"
  for v in "${order[@]}"; do
    rate[$v,$r]=$(run "$v")
    line+=" $v ${rate[$v,$r]}"
  done
  echo "$line tok/s"
done
median() { sort -g | awk '{ a[NR] = $1 } END { if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
printf '\n| variant | tok/s median (min-max) | vs none of its build (median of rounds) |\n|---|---|---|\n'
for v in "${variants[@]}"; do
  vals=$(for ((r = 0; r < rounds; r++)); do echo "${rate[$v,$r]}"; done)
  ref=none
  [ "${v#base:}" = "$v" ] || ref=base:none
  ratios=$(for ((r = 0; r < rounds; r++)); do
    case "${rate[$v,$r]}${rate[$ref,$r]}" in *">"*) continue ;; esac
    awk -v a="${rate[$v,$r]}" -v b="${rate[$ref,$r]}" 'BEGIN { printf "%.3f\n", a / b }'; done)
  late=$(grep -c '>' <<<"$vals" || true)
  vals=$(grep -v '>' <<<"$vals" || true)
  cell="-"
  [ -z "$vals" ] || cell="$(median <<<"$vals") ($(sort -g <<<"$vals" | head -n1)-$(sort -g <<<"$vals" | tail -n1))"
  [ "$late" = 0 ] || cell+=", $late of $rounds jobs cancelled after $limit s"
  rcell="-"
  [ -z "$ratios" ] || rcell=$(median <<<"$ratios" | awk '{ printf "%.2f", $1 }')
  printf '| %s | %s | %s |\n' "$v" "$cell" "$rcell"
done
echo
echo "command: NODES=$nodes RANKS=$ranks ROUNDS=$rounds STEPS=$steps LIMIT=$limit${extra[*]:+ ARGS=\"${extra[*]}\"} perf/bench_qos.sh $build $baseline"
