#!/usr/bin/env python3
"""obs.trace: a 2-rank dt_train with --trace.dir writes trace-rank0.json and trace-rank1.json.
Each parses as a Chrome trace, each rank is its own process (pid = rank, named), complete events
have non-negative durations and nest properly on every thread (B/E pairs, if any, match), and
the expected regions are there: steps, forward and backward per layer, micro-batches, optimizer,
checkpoint phases on their own named threads. dt_trace merge keeps every event of both files in
one trace with two processes; on a missing file, a file that is not JSON, JSON that is not a
trace, or two files of the same rank it exits 2 naming the file and leaves OUT untouched. The
files of one run share a run id and say the run's size; a later 1-rank run into the same folder
leaves rank 1's file of the earlier run, and merging the folder's files is refused, naming both
runs, while the new run's file alone merges with a note that the run had 1 rank. A rank that
fails (the seam test.fail-rank=1, exit 3) has every rank write its timeline before the job is
aborted; so does a sealed message that fails authentication (exit 5), whose rank also exports its
metrics with the failure counted."""
import collections
import json
import os
import re
import sys

import obslib
from obslib import check, fail

a = obslib.Args(sys.argv)
STEPS, LAYERS, MICRO = 4, 2, 2  # micro.ini: 2 layers, batch 8 -> 4 per rank, 2 micro-batches
rc, out = obslib.run(a.train_cmd(2, "--train.steps=%d" % STEPS, "--train.micro-batch=2",
                                 "--trace.dir=tr", "--ckpt.dir=ck", "--ckpt.every=2",
                                 "--train.eval-every=0"))
check(rc == 0, "dt_train exit code %s, expected 0" % rc)
check("timeline written to tr/trace-rank0.json" in out, "no 'timeline written' line")


def check_events(events, where):
    """Per (pid, tid): X events nest, B/E pairs match. Returns the X events."""
    xs, stacks = [], collections.defaultdict(list)
    for e in events:
        ph = e.get("ph")
        if ph == "X":
            if not check(e.get("dur", -1) >= 0, "%s: X event without a non-negative dur: %s" % (where, e)):
                continue
            xs.append(e)
        elif ph == "B":
            stacks[(e["pid"], e["tid"])].append(e)
        elif ph == "E":
            st = stacks[(e["pid"], e["tid"])]
            if check(st, "%s: E without B: %s" % (where, e)):
                b = st.pop()
                check(e["ts"] >= b["ts"], "%s: E before its B: %s" % (where, e))
    for k, st in stacks.items():
        check(not st, "%s: B events never ended on %s: %s" % (where, k, st))
    by_thread = collections.defaultdict(list)
    for e in xs:
        by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for k, evs in by_thread.items():
        evs.sort(key=lambda t: (t[0], -t[1]))
        open_ = []
        for b, end, name in evs:
            while open_ and open_[-1][1] <= b + 1.0:  # 1 us of slack for JSON rounding
                open_.pop()
            if open_:
                check(end <= open_[-1][1] + 1.0,
                      "%s: %s [%.3f, %.3f] overlaps %s [%.3f, %.3f] on thread %s without nesting"
                      % (where, name, b, end, open_[-1][2], open_[-1][0], open_[-1][1], k))
            open_.append((b, end, name))
    return xs


docs = {}
for rank in (0, 1):
    path = "tr/trace-rank%d.json" % rank
    try:
        docs[rank] = json.load(open(path))
    except (OSError, ValueError) as e:
        fail("%s: %s" % (path, e))
        continue
    d = docs[rank]
    events = d.get("traceEvents")
    if not check(isinstance(events, list) and events, "%s: no traceEvents array" % path):
        continue
    check(all(e.get("pid") == rank for e in events), "%s: an event is not in process %d" % (path, rank))
    meta = [e for e in events if e.get("ph") == "M"]
    check(any(e["name"] == "process_name" and e["args"]["name"] == "rank %d" % rank for e in meta),
          "%s: no process_name 'rank %d'" % (path, rank))
    thread_names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    xs = check_events(events, path)
    for e in xs:
        check(e["tid"] in thread_names, "%s: thread %s has no thread_name" % (path, e["tid"]))
    names = collections.Counter(e["name"] for e in xs)
    print("%s: %d events, threads %s, regions %s" % (path, len(events), sorted(set(thread_names.values())), dict(names)))
    check(names["step"] == STEPS, "%s: %d step events, expected %d" % (path, names["step"], STEPS))
    check(names["optimizer"] == STEPS, "%s: %d optimizer events" % (path, names["optimizer"]))
    check(names["micro-batch"] == STEPS * MICRO, "%s: %d micro-batch events" % (path, names["micro-batch"]))
    check(names["backward"] == STEPS * MICRO * LAYERS, "%s: %d backward events" % (path, names["backward"]))
    check(names["forward"] >= STEPS * MICRO * LAYERS, "%s: %d forward events" % (path, names["forward"]))
    layers = sorted({e["args"]["layer"] for e in xs if e["name"] in ("forward", "backward")})
    check(layers == list(range(LAYERS)), "%s: layer arguments %s" % (path, layers))
    steps = sorted(e["args"]["step"] for e in xs if e["name"] == "step")
    # Numbered from 1, as the progress lines and the step log number them.
    check(steps == list(range(1, STEPS + 1)), "%s: step arguments %s" % (path, steps))
    for region in ("ckpt.save", "ckpt.write", "ckpt.hash", "ckpt.fsync"):
        check(names[region] == 2, "%s: %d %s events, expected 2 (steps 2 and 4)" % (path, names[region], region))
    comm = [e for e in xs if e.get("cat") == "comm"]
    check(len(comm) >= STEPS, "%s: %d collectives (category comm) in the timeline for %d steps"
          % (path, len(comm), STEPS))
    # Each operation the flight recorder saw (a seq; the rest are waits of the training thread)
    # names its communicator, backend and bytes besides its sequence number there, as the
    # recorder and the watchdog's dump do; (comm, seq) identifies it.
    ops = [e for e in comm if "seq" in e.get("args", {})]
    check(len(ops) >= STEPS, "%s: %d recorded operations for %d steps" % (path, len(ops), STEPS))
    for e in ops:
        args = e.get("args", {})
        if not check(isinstance(args.get("comm"), str) and args["comm"] and
                     isinstance(args.get("backend"), str) and args.get("bytes", -1) >= 0 and
                     isinstance(args.get("seq"), int), "%s: comm event without comm, backend, bytes or seq: %s" % (path, e)):
            break
    keys = [(e["args"].get("comm"), e["args"].get("seq")) for e in ops]
    check(len(keys) == len(set(keys)), "%s: two comm events share a communicator and sequence number" % path)
    check(any(e["args"].get("comm") == "world" and e["name"] == "all_reduce" and e["args"]["bytes"] > 0
              for e in ops), "%s: no all_reduce on world with its bytes" % path)
    # A checkpoint save is watched for hangs like a collective, but moves no tensors between
    # ranks: it is a ckpt.save region, not a comm event.
    saves = [e["name"] for e in comm if e["name"] == "save"]
    check(not saves, "%s: %d checkpoint saves among the comm events" % (path, len(saves)))
    if rank == 0:
        check(names["ckpt.commit"] == 2, "%s: %d ckpt.commit events" % (path, names["ckpt.commit"]))
    hash_threads = {thread_names.get(e["tid"]) for e in xs if e["name"] == "ckpt.hash"}
    check(hash_threads == {"ckpt-hash"}, "%s: ckpt.hash ran on threads %s" % (path, hash_threads))
    main_tid = next((t for t, n in thread_names.items() if n == "main"), None)
    check(all(e["tid"] == main_tid for e in xs if e["name"] == "step"), "%s: steps not on 'main'" % path)
    # Layers sit inside steps (or evaluations) of the same thread.
    for e in xs:
        if e["name"] == "backward":
            inside = any(s["tid"] == e["tid"] and s["ts"] - 1 <= e["ts"] and
                         e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1
                         for s in xs if s["name"] == "step")
            check(inside, "%s: a backward event outside every step: %s" % (path, e))

# ---- dt_trace merge ---------------------------------------------------------------------------
rc, out = obslib.run([a.trace, "merge", "merged.json", "tr/trace-rank0.json", "tr/trace-rank1.json"])
check(rc == 0, "dt_trace merge exit code %s" % rc)
try:
    merged = json.load(open("merged.json"))
    mev = merged["traceEvents"]
except (OSError, ValueError, KeyError) as e:
    fail("merged.json: %s" % e)
    mev = []
if len(docs) == 2:
    inputs = docs[0]["traceEvents"] + docs[1]["traceEvents"]
    check(len(mev) == len(inputs), "merge has %d events, the inputs %d" % (len(mev), len(inputs)))
    key = lambda e: json.dumps(e, sort_keys=True)
    check(collections.Counter(map(key, mev)) == collections.Counter(map(key, inputs)),
          "merge changed, lost or added events")
    check({e["pid"] for e in mev} == {0, 1}, "merge processes: %s" % {e["pid"] for e in mev})
    check(sum(1 for e in mev if e.get("name") == "process_name") == 2, "merge: not one process_name per rank")
    check_events(mev, "merged.json")
# Summary rows: total ms, calls, mean ms, max ms, ranks, category, name; by total, largest first.
ROW = re.compile(r"^\s*([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\S+)\s+(.+?)\s*$")
def summary_rows(out):
    return [(float(m.group(1)), int(m.group(2)), int(m.group(5)), m.group(7))
            for m in map(ROW.match, out.splitlines()) if m]
rc, out = obslib.run([a.trace, "summary", "merged.json", "--top", "100"])
rows = summary_rows(out)
check(rc == 0 and "2 processes" in out, "dt_trace summary: exit code %s, expected 0 and 2 processes" % rc)
step = [r for r in rows if r[3] == "step"]
check(len(step) == 1 and step[0][1:3] == (8, 2),
      "dt_trace summary: expected one row 'step' of 8 calls on 2 ranks (4 steps a rank), got %s" % step)
check([r[0] for r in rows] == sorted((r[0] for r in rows), reverse=True),
      "dt_trace summary: rows not by total time, largest first")
check("warning" not in out, "dt_trace summary warns of a complete timeline: %s" % out)
# A timeline that lost events past dt_train's per-thread limit (otherData.dropped, as dt_train
# writes it) says so in summary and merge, and the merge keeps the count.
for rank, lost in ((0, 7), (1, 5)):
    with open("tr/trace-rank%d.json" % rank) as f:
        d = json.load(f)
    d["otherData"]["dropped"] = lost
    with open("lossy-%d.json" % rank, "w") as f:
        json.dump(d, f)
rc, out = obslib.run([a.trace, "summary", "lossy-0.json"])
check(rc == 0 and "warning: the timeline lacks 7 events that came after the first 1048576" in out,
      "dt_trace summary of a timeline that lost events: exit code %s: %s" % (rc, out))
rc, out = obslib.run([a.trace, "merge", "lossy.json", "lossy-0.json", "lossy-1.json"])
check(rc == 0 and "lacks 12 events" in out, "dt_trace merge of timelines that lost events: %s" % out)
check(json.load(open("lossy.json"))["otherData"].get("dropped") == 12,
      "the merged timeline does not count the events lost")
# The time a region takes depends on the load of the machine; --top keeps the largest N.
rc, out5 = obslib.run([a.trace, "summary", "merged.json", "--top", "5"])
check(rc == 0 and summary_rows(out5) == rows[:5],
      "dt_trace summary --top 5: expected the first 5 rows of the full summary, got %s" % summary_rows(out5))

# Bad inputs: exit 2, the file named, OUT untouched.
open("notjson.json", "w").write("{ this is not json")
open("nottrace.json", "w").write('{"hello": [1, 2]}')
open("badevent.json", "w").write('{"traceEvents": [{"name": "x"}]}')
open("hugenum.json", "w").write('{"traceEvents": [{"name": "x", "ph": "X", "ts": 1e400, "dur": 1, "pid": 0, "tid": 0}]}')
open("deep.json", "w").write('{"traceEvents": [{"name": "x", "ph": "X", "ts": 1, "dur": 1, "pid": 0, "tid": 0, "args": '
                             + '[' * 100000 + ']' * 100000 + '}]}')
open("out.json", "w").write("previous")
cases = [
    (["hugenum.json"], "hugenum.json: not JSON"),
    (["deep.json"], "deep.json: values nested deeper than 256 levels"),
    (["tr/trace-rank0.json", "missing.json"], "missing.json"),
    (["notjson.json"], "notjson.json: not JSON"),
    (["nottrace.json"], "nottrace.json: not a Chrome trace"),
    (["badevent.json"], "badevent.json: event 0"),
    (["tr/trace-rank0.json", "tr/trace-rank1.json", "merged.json"], "merged.json: rank (pid) 0 also appears"),
    (["tr/trace-rank0.json", "."], ".: is a directory, not a trace file"),
]
for inputs, want in cases:
    rc, out = obslib.run([a.trace, "merge", "out.json"] + inputs)
    check(rc == 2, "merge %s: exit code %s, expected 2" % (inputs, rc))
    check(want in out, "merge %s: no message containing '%s'" % (inputs, want))
    check(open("out.json").read() == "previous", "merge %s: out.json was changed" % inputs)
    check(not [f for f in os.listdir(".") if f.startswith("out.json.tmp")], "a temporary file was left")
# OUT forgotten (rank 0's trace would be OUT), or OUT one of the inputs: refused, nothing changed;
# an earlier merge is replaced.
rank0 = open("tr/trace-rank0.json").read()
rc, out = obslib.run([a.trace, "merge", "tr/trace-rank0.json", "tr/trace-rank1.json"])
check(rc == 2 and "tr/trace-rank0.json exists and is not a trace that dt_trace merge wrote" in out,
      "merge without OUT: exit code %s" % rc)
check(open("tr/trace-rank0.json").read() == rank0, "merge without OUT changed tr/trace-rank0.json")
merged_text = open("merged.json").read()
rc, out = obslib.run([a.trace, "merge", "merged.json", "merged.json"])
check(rc == 2 and "OUT merged.json is also an input (merged.json)" in out,
      "merge into one of its inputs: exit code %s" % rc)
check(open("merged.json").read() == merged_text, "merge into one of its inputs changed it")
# OUT a folder: refused as such (it was an internal error, exit 3).
rc, out = obslib.run([a.trace, "merge", "tr", "tr/trace-rank0.json", "tr/trace-rank1.json"])
check(rc == 2 and "OUT tr is a folder: name the file to write the merged timeline to" in out,
      "merge into a folder: exit code %s: %s" % (rc, out))
rc, out = obslib.run([a.trace, "merge", "merged.json", "tr/trace-rank1.json", "tr/trace-rank0.json"])
check(rc == 0, "merge over an earlier merge: exit code %s" % rc)
# Counts of one are singular.
rc, out = obslib.run([a.trace, "merge", "one.json", "tr/trace-rank1.json"])
check(rc == 0 and re.search(r"events? of 1 process from 1 file -> one\.json$", out, re.M),
      "merge of one file: exit code %s, expected 'of 1 process from 1 file'" % rc)
rc, out = obslib.run([a.trace, "summary", "one.json"])
check(rc == 0 and ": 1 process, " in out, "summary of one rank: exit code %s, expected '1 process'" % rc)
rc, out = obslib.run([a.trace, "merge", "never.json"])
check(rc == 2 and not os.path.exists("never.json"), "merge without inputs: exit code %s" % rc)
rc, out = obslib.run([a.trace, "summary", "merged.json", "--top"])
check(rc == 2 and "option --top needs a number" in out, "summary with a bare --top: exit code %s" % rc)
rc, out = obslib.run([a.trace, "summary", "merged.json", "--tpo", "3"])
check(rc == 2 and "unknown option '--tpo'" in out, "summary with an unknown option: exit code %s" % rc)
# One run id for both ranks' files, and the run's size.
runs = {r: d.get("otherData", {}).get("run") for r, d in docs.items()}
check(len(set(runs.values())) == 1 and re.fullmatch(r"[0-9a-f]{16}", str(runs.get(0))),
      "the ranks' files do not share one run id: %s" % runs)
check(all(d.get("otherData", {}).get("world") == 2 for d in docs.values()), "a file does not say world 2")
check(json.load(open("merged.json")).get("otherData", {}).get("run") == runs.get(0),
      "the merge does not keep the run id")
# A later run of 1 rank into the same folder: rank 1's file is the earlier run's.
rc, out = obslib.run(a.train_cmd(1, "--train.steps=1", "--trace.dir=tr", "--train.eval-every=0"))
check(rc == 0, "the 1-rank dt_train exit code %s, expected 0" % rc)
new_run = json.load(open("tr/trace-rank0.json")).get("otherData", {}).get("run")
check(new_run and new_run != runs.get(0), "the second run has the first one's id %s" % new_run)
with open("mixed.json", "w") as f:
    f.write("previous")
rc, out = obslib.run([a.trace, "merge", "mixed.json", "tr/trace-rank0.json", "tr/trace-rank1.json"])
check(rc == 2 and "the inputs come from 2 different runs" in out and str(new_run) in out and
      str(runs.get(0)) in out, "merge of two runs' files: exit code %s: %s" % (rc, out.strip()))
check(open("mixed.json").read() == "previous", "merge of two runs' files changed its OUT")
rc, out = obslib.run([a.trace, "merge", "alone.json", "tr/trace-rank0.json"])
check(rc == 0 and "the run had 1 rank" not in out, "merge of the 1-rank run: exit code %s: %s" % (rc, out))
rc, out = obslib.run([a.trace, "merge", "half.json", "tr/trace-rank1.json"])
check(rc == 0 and "note: the run had 2 ranks; the timeline holds 1 of them" in out,
      "merge of one rank of two: exit code %s: %s" % (rc, out.strip()))
# A failure on one rank: every rank's timeline is written before the abort.
rc, out = obslib.run(a.train_cmd(2, "--train.steps=5", "--trace.dir=failed", "--train.eval-every=0",
                                 "--test.fail-rank=1", "--test.fail-step=2"))
check(rc == 3, "the failing run: exit code %s, expected 3" % rc)
check("test.fail-rank: failing at step 3" in out, "rank 1 did not fail at step 3")
for rank in (0, 1):
    path = "failed/trace-rank%d.json" % rank
    try:
        d = json.load(open(path))
        check(any(e.get("name") == "step" for e in d["traceEvents"]), "%s: no step" % path)
    except (OSError, ValueError, KeyError) as e:
        fail("after a failure on rank 1: %s: %s" % (path, e))
# A sealed message that fails authentication (rank 1 flips a bit of its 6th sealed message, the
# receiver rejects it): exit 5, every rank's timeline written, and the rejecting rank's metrics
# exported before the abort with the failure counted. A clean sealed run exports the counters at 0.
key = os.path.join(a.work, "job.key")
with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
    f.write(os.urandom(32))
sealed = ["--security.seal=all", "--security.key_file=" + key]
rc, out = obslib.run(a.train_cmd(2, "--train.steps=2", "--train.eval-every=0", *sealed,
                                 "--metrics.textfile=clean-{rank}.prom"))
check(rc == 0, "the clean sealed run: exit code %s" % rc)
for rank in (0, 1):
    try:
        samples = obslib.parse_prometheus(open("clean-%d.prom" % rank).read())[2]
        zeros = {l.get("reason"): v for n, l, v in samples if n == "dt_security_auth_failures_total"}
        check(zeros == {"malformed": 0, "authentication": 0, "sequence": 0, "redirected": 0},
              "clean-%d.prom: auth failure counters %s, expected all four reasons at 0" % (rank, zeros))
    except (OSError, obslib.ParseError) as e:
        fail("clean-%d.prom: %s" % (rank, e))
rc, out = obslib.run(a.train_cmd(2, "--train.steps=5", "--trace.dir=sealed", "--train.eval-every=0",
                                 *sealed, "--test.tamper=flip:5", "--test.tamper-rank=1",
                                 "--metrics.textfile=sealed-{rank}.prom"))
check(rc == 5, "the tampered run: exit code %s, expected 5" % rc)
for rank in (0, 1):
    path = "sealed/trace-rank%d.json" % rank
    try:
        json.load(open(path))
    except (OSError, ValueError) as e:
        fail("after a rejected sealed message: %s: %s" % (path, e))
counted = 0
for rank in (0, 1):
    try:
        samples = obslib.parse_prometheus(open("sealed-%d.prom" % rank).read())[2]
        counted += sum(v for n, l, v in samples if n == "dt_security_auth_failures_total"
                       and l.get("reason") == "authentication")
    except OSError:
        pass  # a rank aborted before its first export
    except obslib.ParseError as e:
        fail("sealed-%d.prom: %s" % (rank, e))
check(counted >= 1, "no rank's exported metrics count the rejected message")
rc, out = obslib.run([a.trace, "frobnicate"])
check(rc == 2 and "unknown subcommand 'frobnicate'" in out, "unknown subcommand: exit code %s" % rc)
obslib.finish(a)
