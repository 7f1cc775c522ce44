#!/usr/bin/env bash
# Sealed tensor traffic against its ceilings and against a baseline, side by side in one run.
#   perf/bench_seal.sh [BUILD_DIR] [BASELINE_BENCH]
# Each of ROUNDS rounds (default 3) records the load (uptime), then runs back to back:
#   1. openssl speed -elapsed -evp aes-256-gcm, 1 MiB blocks, wall clock as bench_seal measures:
#      one process on one core (taskset -c 0), and two processes at once (-multi 2; per process:
#      what each of bench_seal's two ranks can have when the machine is shared, see below)
#   2. bench_seal of BUILD_DIR (default build/; the bench_seal target is built first) on 2 ranks
#   3. BASELINE_BENCH, if given: a bench_seal binary built from the same perf/bench_seal.cpp
#      against another dt (the previous implementation), same arguments; its order with 2.
#      alternates between rounds
# and then prints per round and as medians over the rounds: sealed p2p as a fraction of openssl's
# one-core rate (one process alone, and per process of two) and of plain MPI, sealed all_reduce as
# a fraction of MPI_Allreduce and of dt's algorithm unsealed, each for this build and the
# baseline; and sealed p2p against what a receiver that copies (as plain MPI does) and then opens
# every byte can reach at best, 1 / (1/open + 1/plain), and sealed all_reduce (2 ranks) against
# dt's algorithm unsealed plus the AES-GCM work of each rank (it seals and opens 2 n bytes for n),
# 1 / (1/unsealed + 2/seal). On an idle machine each rank has a core and the two openssl figures agree; on a
# shared one (Linux autogroups: every session gets an equal share of the cores) the two ranks of
# bench_seal share one session's share, as the two openssl processes of -multi 2 do, while a
# single openssl process has it alone.
# NODES=2 runs bench_seal across two namespaced nodes, one rank each (TCP over a veth bridge;
# tests/multinode/mpirun-nodes.sh, needs root; it creates and removes the dtn* namespaces, so
# nobody else may be using them: `ip netns list`). NODES=1 (default): mpiexec -n 2 on this node
# (shared memory). SESSIONS=1 starts each rank and openssl in a session of its own (setsid): Linux
# gives every session (autogroup) an equal share of the cores, so each rank then has the share a
# lone openssl process has, instead of the two ranks sharing one session's share; the default
# starts them as mpiexec does. BENCH_ARGS (default "--iters 5") go to bench_seal.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
baseline=${2:-}
rounds=${ROUNDS:-3}
nodes=${NODES:-1}
args=(${BENCH_ARGS:---iters 5})
cmake --build "$build" --target bench_seal -j "$(nproc)" >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
sessions=${SESSIONS:-0}
own=()
[ "$sessions" = 1 ] && own=(setsid -w)
run() {
  if [ "$nodes" = 2 ]; then
    if ip netns list | grep -q '^dtn'; then
      echo "bench_seal.sh: the dtn* namespaces are in use (ip netns list); not touching them" >&2
      exit 1
    fi
    "$here/../tests/multinode/mpirun-nodes.sh" 2 1 "${own[@]}" "$@"
  else
    mpiexec -n 2 "${own[@]}" "$@"
  fi
}
out=$(mktemp /tmp/dt-bench-seal.XXXXXX)
trap 'rm -f "$out"' EXIT
echo "bench_seal: $(nproc) cores, nodes=$nodes, sessions=$sessions, ${rounds} rounds, bench_seal" \
  "${args[*]}"
for r in $(seq "$rounds"); do
  {
    echo "round $r load $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "round $r openssl $("${own[@]}" taskset -c 0 openssl speed -elapsed -evp aes-256-gcm -seconds 2 \
      -bytes 1048576 2>/dev/null | tail -n 1)"
    echo "round $r openssl-multi2 $("${own[@]}" openssl speed -elapsed -multi 2 -evp aes-256-gcm -seconds 2 \
      -bytes 1048576 2>/dev/null | tail -n 1)"
    order=(new)
    if [ -n "$baseline" ]; then
      if [ $((r % 2)) = 1 ]; then order=(new base); else order=(base new); fi
    fi
    for which in "${order[@]}"; do
      bin=$build/tests/security/bench_seal
      [ "$which" = base ] && bin=$baseline
      run "$bin" "${args[@]}" | sed "s/^/round $r $which /"
    done
    echo "round $r load-after $(cut -d' ' -f1-3 /proc/loadavg)"
  } | tee -a "$out"
done
python3 - "$out" <<'PY'
import re, statistics, sys
rows = {}  # (round, which) -> {case: GB/s}
ssl, ssl2, load = {}, {}, {}
for line in open(sys.argv[1]):
    m = re.match(r"round (\d+) openssl (?:AES-256-GCM|evp)\s+([\d.]+)k", line)
    if m:
        ssl[m[1]] = float(m[2]) * 1e3 / 1e9
        continue
    m = re.match(r"round (\d+) openssl-multi2 (?:AES-256-GCM|evp)\s+([\d.]+)k", line)
    if m:  # the sum over the two processes
        ssl2[m[1]] = float(m[2]) * 1e3 / 1e9 / 2
        continue
    m = re.match(r"round (\d+) (load|load-after) (.*)", line)
    if m:
        load.setdefault(m[1], []).append(m[3])
        continue
    m = re.match(r"round (\d+) (new|base) (.*\S)\s+([\d.]+)(?:\s+\(.*\))?\s*$", line)
    if m:
        rows.setdefault((m[1], m[2]), {})[m[3].strip()] = float(m[4])
def ratios(r, which):
    c = rows.get((r, which), {})
    out = {}
    for mib in (1, 4, 16):
        s, p = c.get(f"p2p {mib:5d} MiB sealed"), c.get(f"p2p {mib:5d} MiB plain MPI")
        if s and r in ssl:
            out[f"p2p {mib:2d} MiB sealed / openssl, alone"] = s / ssl[r]
        if p and r in ssl:  # the transport alone, no cryptography
            out[f"p2p {mib:2d} MiB plain / openssl, alone"] = p / ssl[r]
        if s and r in ssl2:
            out[f"p2p {mib:2d} MiB sealed / openssl, one of two"] = s / ssl2[r]
        if s and p:
            out[f"p2p {mib:2d} MiB sealed / plain"] = s / p
        o = c.get("open  256 KiB in place (one core)")
        if s and p and o:  # one node: the receiver copies (the transport) and opens each byte
            out[f"p2p {mib:2d} MiB sealed / (1/(1/open + 1/plain))"] = s * (1 / o + 1 / p)
    s = c.get("all_reduce 16 MiB f32 dt sealed")
    m, u = c.get("all_reduce 16 MiB f32 MPI_Allreduce"), c.get("all_reduce 16 MiB f32 dt, unsealed")
    if s and m:
        out["all_reduce 16 MiB sealed / MPI"] = s / m
    if s and u:
        out["all_reduce 16 MiB sealed / dt unsealed"] = s / u
    a = c.get("seal 1024 KiB (one core)")
    if s and u and a:  # each rank seals and opens 2 n (n - 1) / n, on top of the unsealed work
        out["all_reduce 16 MiB sealed / (1/(1/unsealed + 2/seal))"] = s * (1 / u + 2 / a)
    return out
print("\n== summary (ratios within one round; load = 1/5/15-min load average before and after)")
for r in sorted(ssl, key=int):
    print(f"round {r}: openssl one process {ssl[r]:.2f} GB/s, each of two {ssl2.get(r, 0):.2f} "
          f"GB/s; load {' -> '.join(load.get(r, []))}")
whiches = [w for w in ("new", "base") if any(k[1] == w for k in rows)]
keys = sorted({k for r in ssl for w in whiches for k in ratios(r, w)})
width = max([len(k) for k in keys] + [5])
print(f"{'ratio':{width}}" + "".join(f"  {w + ': median (min-max)':>24}" for w in whiches))
for k in keys:
    line = f"{k:{width}}"
    for w in whiches:
        v = [ratios(r, w)[k] for r in ssl if k in ratios(r, w)]
        cell = f"{statistics.median(v):.0%} ({min(v):.0%}-{max(v):.0%})" if v else "-"
        line += f"  {cell:>24}"
    print(line)
PY
