#!/usr/bin/env bash
# Sealed tensor traffic against its ceilings and against a baseline, side by side in one run.
#   perf/bench_seal.sh [BUILD_DIR] [BASELINE_BENCH]
#   BASE_ARGS="--aes openssl" perf/bench_seal.sh [BUILD_DIR]
# Each of ROUNDS rounds (default 3) records the load (uptime), then runs back to back:
#   1. openssl speed -elapsed -evp aes-256-gcm, 1 MiB blocks, wall clock as bench_seal measures:
#      one process on one core (taskset -c 0), and two processes at once (-multi 2; per process:
#      what each of bench_seal's two ranks can have when the machine is shared, see below)
#   2. bench_seal of BUILD_DIR (default build/; the bench_seal target is built first) on 2 ranks
#   3. BASELINE_BENCH, if given: a bench_seal binary built from the same perf/bench_seal.cpp
#      against another dt (the previous implementation), same arguments; its order with 2.
#      alternates between rounds; or, without BASELINE_BENCH and with BASE_ARGS set, this build's
#      bench_seal again with BASE_ARGS added (another AES-GCM code: "--aes openssl")
# and then prints per round and as medians over the rounds, for each sealed path of each binary
# (this build: through the shared-memory mailboxes and through the transport alone, side by side
# in the same process; a baseline before the mailboxes: its one path): sealed p2p as a fraction of
# openssl's one-core rate (one process alone, and per process of two) and of plain MPI, sealed
# all_reduce as a fraction of MPI_Allreduce and of dt's algorithm unsealed; sealed p2p against its
# bound on one node (through the transport the receiver copies, as plain MPI does, and then opens
# every byte: 1 / (1/open + 1/plain); through the mailboxes sender and receiver each make one
# AES-GCM pass on their own core: min(seal, open)), and sealed all_reduce (2 ranks) against its
# bound (through the transport: dt's algorithm unsealed plus the AES-GCM work of each rank, which
# seals and opens n bytes each for n, 1 / (1/unsealed + 2/seal); through the mailboxes: that
# AES-GCM work and the reduction of the rank's half alone, 1 / (1/seal + 1/open + 0.5/reduce)), and
# the 16 MiB stream through the mailboxes against min(seal, open) of both ranks streaming 16 MiB
# buffers from memory at once ("bound streamed"). Across two nodes there are no same-node peers: both paths of this
# build take the transport. On an idle machine each rank has a core and the two openssl figures agree; on a
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
base_args=(${BASE_ARGS:-})
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
    if [ -n "$baseline" ] || [ ${#base_args[@]} -gt 0 ]; then
      if [ $((r % 2)) = 1 ]; then order=(new base); else order=(base new); fi
    fi
    for which in "${order[@]}"; do
      bin=$build/tests/security/bench_seal
      extra=()
      if [ "$which" = base ]; then
        [ -n "$baseline" ] && bin=$baseline
        extra=(${base_args[@]+"${base_args[@]}"})
      fi
      run "$bin" "${args[@]}" ${extra[@]+"${extra[@]}"} | sed "s/^/round $r $which /"
    done
    echo "round $r load-after $(cut -d' ' -f1-3 /proc/loadavg)"
  } | tee -a "$out"
done
python3 - "$out" "$nodes" "${args[*]}" <<'PY'
import re, statistics, sys
two_nodes = len(sys.argv) > 2 and sys.argv[2] == "2"
window = (re.findall(r"--window[ =](\d+)", sys.argv[3]) or ["4"])[-1]  # bench_seal's default
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
        rows.setdefault((m[1], m[2]), {})[re.sub(r"\s+", " ", m[3].strip())] = float(m[4])
# The sealed paths a binary reports: "sealed, shared memory" and "sealed, transport" (this
# implementation), or "sealed" (one before the mailboxes).
def paths(c):
    found = [p for p in ("shared memory", "transport") if f"p2p 1 MiB sealed, {p}" in c or
             f"all_reduce 16 MiB f32 dt sealed, {p}" in c]
    return found or ["sealed"]
def sealed_key(kind, path):
    name = "sealed" if path == "sealed" else f"sealed, {path}"
    return f"p2p {kind} MiB {name}" if kind else f"all_reduce 16 MiB f32 dt {name}"
def ratios(r, which):
    c = rows.get((r, which), {})
    out = {}
    seal, opn = c.get("seal 1024 KiB (one core)"), c.get("open 1024 KiB in place (one core)")
    if two_nodes:  # no bounds there (the network sets them), and no same-node peer
        seal = opn = None
    for path in paths(c):
        col = f"{which}: {path}" + (" (no same-node peer)" if two_nodes and path == "shared memory" else "")
        for mib in (1, 4, 16):
            s, p = c.get(sealed_key(mib, path)), c.get(f"p2p {mib} MiB plain MPI")
            if s and r in ssl:
                out[(f"p2p {mib:2d} MiB sealed / openssl, alone", col)] = s / ssl[r]
            if s and r in ssl2:
                out[(f"p2p {mib:2d} MiB sealed / openssl, one of two", col)] = s / ssl2[r]
            if s and p:
                out[(f"p2p {mib:2d} MiB sealed / plain MPI", col)] = s / p
            if p and r in ssl and path != "shared memory":  # the transport alone, no cryptography
                out[(f"p2p {mib:2d} MiB plain MPI / openssl, alone", col)] = p / ssl[r]
            # Bounds on one node: through the transport the receiver copies (as plain MPI does)
            # and then opens each byte, 1 / (1/open + 1/plain); through the mailboxes sender and
            # receiver each make one pass on their own core, min(seal, open).
            if s and p and opn and path != "shared memory":
                out[(f"p2p {mib:2d} MiB sealed / bound", col)] = s * (1 / opn + 1 / p)
            if s and seal and opn and path == "shared memory":
                out[(f"p2p {mib:2d} MiB sealed / bound", col)] = s / min(seal, opn)
            # The same with the rates of both ranks streaming 16 MiB buffers from memory at once.
            ss, so = (c.get(f"{w} 16 MiB x {window} streamed, both ranks (each)") for w in ("seal", "open"))
            if mib == 16 and s and ss and so and path == "shared memory" and not two_nodes:
                out[(f"p2p {mib:2d} MiB sealed / bound streamed", col)] = s / min(ss, so)
        s = c.get(sealed_key(None, path))
        m, u = c.get("all_reduce 16 MiB f32 MPI_Allreduce"), c.get("all_reduce 16 MiB f32 dt, unsealed")
        if s and m:
            out[("all_reduce 16 MiB sealed / MPI_Allreduce", col)] = s / m
        if s and u:
            out[("all_reduce 16 MiB sealed / dt unsealed", col)] = s / u
        red = c.get("reduce 8 MiB f32, two inputs (one core)")
        # Bounds (2 ranks): through the transport, dt's algorithm unsealed plus each rank's AES-GCM
        # work (it seals and opens n bytes each for n), 1/(1/unsealed + 2/seal); through the
        # mailboxes, that work alone and the reduction of its half, 1/(1/seal + 1/open + 0.5/reduce).
        if s and u and seal and path != "shared memory":
            out[("all_reduce 16 MiB sealed / bound", col)] = s * (1 / u + 2 / seal)
        if s and seal and opn and red and path == "shared memory":
            out[("all_reduce 16 MiB sealed / bound", col)] = s * (1 / seal + 1 / opn + 0.5 / red)
    return out
print("\n== summary (ratios within one round; load = 1/5/15-min load average before and after)")
for r in sorted(ssl, key=int):
    print(f"round {r}: openssl one process {ssl[r]:.2f} GB/s, each of two {ssl2.get(r, 0):.2f} "
          f"GB/s; load {' -> '.join(load.get(r, []))}")
allr = {r: {**ratios(r, "new"), **ratios(r, "base")} for r in ssl}
cols = []
for r in allr:
    for (_, col) in allr[r]:
        if col not in cols:
            cols.append(col)
keys = sorted({k for r in allr for (k, _) in allr[r]})
width = max([len(k) for k in keys] + [5])
cw = max([len(c) for c in cols] + [16]) + 2
print(f"{'ratio: median (min-max)':{width}}" + "".join(f"  {c:>{cw}}" for c in cols))
for k in keys:
    line = f"{k:{width}}"
    for col in cols:
        v = [allr[r][(k, col)] for r in allr if (k, col) in allr[r]]
        cell = f"{statistics.median(v):.0%} ({min(v):.0%}-{max(v):.0%})" if v else "-"
        line += f"  {cell:>{cw}}"
    print(line)
PY
