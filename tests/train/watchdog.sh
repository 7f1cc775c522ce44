#!/usr/bin/env bash
# watchdog.sh MODE TIMEOUT DUMPDIR RANK -- CMD...
# CMD is a dt_train job whose hang watchdog has TIMEOUT seconds, and in which rank RANK
#   skip: never joins the loss all_reduce of a step (test.skip-collective): the watchdog must
#         name that rank and that all_reduce on world, and every rank must have written its
#         timeline (trace.dir): the rank that never came writes it when the watchdog asks;
#   skip_sealed: the same with sealed collectives (CMD gives security.seal=all): the all_reduce
#         on world/sealed;
#   save: stops inside a checkpoint save (test.stall-during-save), so the other ranks hang inside
#         HDF5's collective writes: the watchdog (with ckpt.timeout-s = TIMEOUT, the saves'
#         limit, and comm.timeout-s = 0: no limit for other operations) must name the save and
#         say every rank is in it;
#   pipe: a pipeline stage (pp=2) stops before a step (test.stall-rank), so the other stage waits
#         for its gradients in a point-to-point receive: the watchdog must name the receive, the
#         rank it waits for and what that rank is doing;
#   eval: the rank stops before the evaluation after step 2 (test.stall-at=evaluation), so the
#         others wait in the evaluation's all_reduce: the dump must say so (activity
#         "evaluation" at step 2) and the line must name the stopped rank and what it does;
#   micro: the rank stops after step 3's first micro-batch (test.stall-at=micro-batch), so the
#         others wait in the drain vote at the next boundary (an all_reduce on the vote's own
#         communicator, world/drain-vote): the line must name the stopped rank and what it does;
#   pipe_micro: the same in two pipelines of two stages (dp=2 pp=2, 4 ranks), whose drain votes
#         are read two micro-batches after they are taken: the others wait for the rank's
#         pipeline messages or its vote, and the line must name it and what it does;
#   pipe_vote: the same, but the rank stops just after taking the vote (test.stall-at=after-vote):
#         the line must name the rank as the one whose messages or next vote the others wait
#         for, or, where they wait for the vote it took (in MPI, which it no longer drives), as
#         the one busy elsewhere.
#   pipe_send: a pipeline stage (pp=2) stops before its first backward pass of a step
#         (test.stall-at=backward), so the stage after it waits for the gradients it sent back
#         to be received (messages above the transport's eager limit): the watchdog must name the
#         send, the rank it waits for and what that rank is doing.
# Either way the job must end within TIMEOUT + 10 s of the stall, exit non-zero, print one
# watchdog line and leave a dump that says the same.
set -u
mode=$1 timeout_s=$2 dump=$3 skip=$4
shift 5
rm -rf "$dump"
mkdir -p "$dump"
log=$dump/job.log
comm_limit=$timeout_s
# The drain votes' communicator (sealed: its sealed communicator's name).
vote=world/drain-vote
case " $* " in *" --security.seal=all "*) vote=world/drain-vote/sealed ;; esac
case $mode in
  skip|skip_sealed) extra=(--test.skip-collective="$skip" --trace.dir="$dump/trace")
        mark="rank $skip: test.skip-collective: skipping" ;;
  save) extra=(--test.stall-during-save="$skip" --ckpt.dir="$dump/ckpt" --ckpt.every=2
               --ckpt.timeout-s="$timeout_s")
        comm_limit=0
        mark="rank $skip: in the checkpoint save" ;;
  pipe) extra=(--test.stall-rank="$skip" --parallel.pp=2)
        mark="rank $skip: test.stall-rank: stopping before the step" ;;
  eval) extra=(--test.stall-rank="$skip" --test.stall-at=evaluation --train.eval-every=2)
        mark="rank $skip: test.stall-rank: stopping before the evaluation" ;;
  micro) extra=(--test.stall-rank="$skip" --test.stall-at=micro-batch --train.micro-batch=1)
         mark="rank $skip: test.stall-rank: stopping after the first micro-batch" ;;
  pipe_micro) extra=(--test.stall-rank="$skip" --test.stall-at=micro-batch --train.micro-batch=1
                     --parallel.pp=2)
         mark="rank $skip: test.stall-rank: stopping after the first micro-batch" ;;
  pipe_vote) extra=(--test.stall-rank="$skip" --test.stall-at=after-vote --train.micro-batch=1
                    --parallel.pp=2)
         mark="rank $skip: test.stall-rank: stopping after taking a drain vote" ;;
  pipe_send) extra=(--test.stall-rank="$skip" --test.stall-at=backward --parallel.pp=2)
         mark="rank $skip: test.stall-rank: stopping before the first backward pass" ;;
  *) echo "watchdog.sh: unknown mode $mode"; exit 2 ;;
esac
"$@" --comm.timeout-s="$comm_limit" --comm.dump-dir="$dump" "${extra[@]}" >"$log" 2>&1 &
pid=$!
t_skip=""
while kill -0 "$pid" 2>/dev/null; do
  if [ -z "$t_skip" ] && grep -q "$mark" "$log"; then
    t_skip=$(date +%s.%N)
  fi
  sleep 0.1
done
wait "$pid"
rc=$?
t_end=$(date +%s.%N)
cat "$log"
fail() { echo "watchdog.sh: FAIL: $*"; exit 1; }
[ -n "$t_skip" ] || fail "rank $skip never reported skipping the collective"
[ "$rc" -ne 0 ] || fail "the job exited 0"
took=$(awk -v a="$t_end" -v b="$t_skip" 'BEGIN { printf "%.1f", a - b }')
awk -v t="$took" -v l="$timeout_s" 'BEGIN { exit !(t <= l + 10) }' || fail "the job ended ${took} s after the skip (limit $timeout_s + 10 s)"
line=$(grep -m1 '^dt watchdog: ' "$log") || fail "no watchdog line"
# What the line must say, by mode: a regular expression, and what it names.
h=$(hostname)
stopped="now test.stall-rank: stopped"
case $mode in
  skip) want="all_reduce #[0-9]+ on world .* rank $skip \\(on $h\\) has not reached it"
        what="rank $skip and the all_reduce on world" ;;
  skip_sealed) want="all_reduce #[0-9]+ on world/sealed \\(f64 x 1, sealed\\) .* rank $skip \\(on $h\\) has not reached it"
        what="rank $skip and the all_reduce on world/sealed" ;;
  eval) want="all_reduce #[0-9]+ on world .* rank $skip \\(on $h\\) has not reached it; rank $skip: last world collective #[0-9]+, $stopped before the evaluation at step 2"
        what="rank $skip, the all_reduce on world and what rank $skip does" ;;
  micro) want="all_reduce #[0-9]+ on $vote .* rank $skip \\(on $h\\) has not reached it; rank $skip: .*$stopped after the first micro-batch"
         what="rank $skip, the drain vote's all_reduce and what rank $skip does" ;;
  pipe_micro) want="(all_reduce #[0-9]+ on $vote .* rank $skip \\(on $h\\) has not reached it|recv from rank $skip on pipeline .* rank $skip \\(on $h\\) has not sent it); rank $skip: .*$stopped after the first micro-batch"
              what="rank $skip, what the others wait for and what rank $skip does" ;;
  pipe_vote) want="(all_reduce #[0-9]+ on $vote .* (every rank has reached it \\(stuck inside the collective\\); rank $skip \\(on $h\\) is in no other operation, busy elsewhere; rank $skip: |rank $skip \\(on $h\\) has not reached it; rank $skip: last $vote collective #[0-9]+, )|recv from rank $skip on pipeline .* rank $skip \\(on $h\\) has not sent it; rank $skip: )$stopped after taking a drain vote"
             what="rank $skip as the one waited for or busy elsewhere, and what it does" ;;
  pipe) want="recv from rank $skip on pipeline .* rank $skip \\(on $h\\) has not sent it; rank $skip: now test.stall-rank"
        what="the receive from rank $skip and what rank $skip does" ;;
  pipe_send) want="send to rank $skip on pipeline .* rank $skip \\(on $h\\) has not received it; rank $skip: $stopped before the first backward pass at step 3"
             what="the send to rank $skip and what rank $skip does" ;;
  save) want="save #1 on checkpoint .* every rank has reached it"
        what="the checkpoint save" ;;
esac
echo "$line" | grep -qE "$want" || fail "the watchdog line does not name $what"
f=$(ls "$dump"/dt-watchdog-rank*.json 2>/dev/null | head -1)
[ -n "$f" ] || fail "no dump in $dump"
python3 - "$f" "$skip" "$mode" "$vote" <<'PY' || fail "dump $f does not say what the line says"
import json, sys
d = json.load(open(sys.argv[1]))
skip, mode, vote = int(sys.argv[2]), sys.argv[3], sys.argv[4]
c = d["collective"]
ranks = {r["rank"]: r for r in d["ranks"]}
if mode in ("skip", "skip_sealed"):
    world = "world" if mode == "skip" else "world/sealed"
    assert d["missing_ranks"] == [skip], d["missing_ranks"]
    assert c["op"] == "all_reduce" and c["comm"] == world and c["seq"] > 0, c
    assert ranks[skip]["comms"][world]["started"] < c["seq"]
    assert "skip-collective" in ranks[skip]["activity"]
    # The others wait in the loss all_reduce of the step the progress lines call 3 (the third,
    # test.skip-step 2 counted from 0).
    for q, r in ranks.items():
        if q != skip:
            assert (r["activity"], r["step"]) == ("loss all_reduce", 3), (q, r["activity"], r["step"])
elif mode == "eval":
    assert d["missing_ranks"] == [skip], d["missing_ranks"]
    assert c["op"] == "all_reduce" and c["comm"] == "world", c
    assert "before the evaluation" in ranks[skip]["activity"], ranks[skip]["activity"]
    for q, r in ranks.items():
        if q != skip:
            assert (r["activity"], r["step"]) == ("evaluation", 2), (q, r["activity"], r["step"])
elif mode == "micro":
    assert d["missing_ranks"] == [skip], d["missing_ranks"]
    assert c["op"] == "all_reduce" and c["comm"] == vote, c
    assert "after the first micro-batch" in ranks[skip]["activity"], ranks[skip]["activity"]
    for q, r in ranks.items():
        if q != skip:
            assert (r["activity"], r["step"]) == ("drain vote", 3), (q, r["activity"], r["step"])
elif mode == "pipe_micro":
    assert d["missing_ranks"] == [skip], d["missing_ranks"]
    assert (c["op"] == "all_reduce" and c["comm"] == vote) or \
        (c["op"] == "recv" and c["comm"] == "pipeline" and c["peer"] == skip), c
    assert "after the first micro-batch" in ranks[skip]["activity"], ranks[skip]["activity"]
    for q, r in ranks.items():
        if q != skip:
            assert r["step"] == 3 and r["activity"] in ("drain vote", "forward and backward"), \
                (q, r["activity"], r["step"])
elif mode == "pipe_vote":
    if c["op"] == "recv":
        assert d["missing_ranks"] == [skip] and c["comm"] == "pipeline" and c["peer"] == skip, c
    else:
        assert c["op"] == "all_reduce" and c["comm"] == vote, c
        assert d["missing_ranks"] == [skip] or \
            (d["missing_ranks"] == [] and d.get("busy_ranks") == [skip]), d
    assert "after taking a drain vote" in ranks[skip]["activity"], ranks[skip]["activity"]
elif mode == "pipe":
    assert d["missing_ranks"] == [skip], d["missing_ranks"]
    assert c["op"] == "recv" and c["comm"] == "pipeline" and c["peer"] == skip, c
    assert "stall-rank" in ranks[skip]["activity"]
elif mode == "pipe_send":
    assert d["missing_ranks"] == [skip], d["missing_ranks"]
    assert c["op"] == "send" and c["comm"] == "pipeline" and c["peer"] == skip, c
    assert "before the first backward pass" in ranks[skip]["activity"], ranks[skip]["activity"]
    for q, r in ranks.items():
        if q != skip:
            assert (r["activity"], r["step"]) == ("forward and backward", 3), \
                (q, r["activity"], r["step"])
else:
    assert d["missing_ranks"] == [], d["missing_ranks"]
    assert c["op"] == "save" and c["comm"] == "checkpoint" and c["seq"] == 1, c
    assert all(r["comms"]["checkpoint"]["started"] == 1 for r in ranks.values())
for r in ranks.values():  # every rank sent its recent collectives
    assert r["records"] and all({"comm", "seq", "op", "bytes"} <= set(x) for x in r["records"])
if mode in ("skip", "skip_sealed"):  # every rank's timeline, with its steps up to the hang
    import os
    for q in ranks:
        t = json.load(open(os.path.join(os.path.dirname(sys.argv[1]), "trace", f"trace-rank{q}.json")))
        assert any(e.get("name") == "step" for e in t["traceEvents"]), f"rank {q}: no step in its trace"
        # The ranks waiting for rank `skip` show the loss all_reduce they waited in, unfinished,
        # once.
        if q != skip:
            u = [e for e in t["traceEvents"] if e.get("cat") == "comm (unfinished)"]
            assert len(u) == 1 and u[0]["name"] == "all_reduce" and u[0]["args"]["comm"] == world, \
                f"rank {q}: unfinished operations {u}"
            # ... inside the step they had not finished (its Scope, still open), which covers it.
            o = [e for e in t["traceEvents"] if e.get("cat") == "train (open)"]
            assert [(e["name"], e["args"]["step"]) for e in o] == [("step", 3)], \
                f"rank {q}: unfinished Scopes {o}"
            assert o[0]["ts"] <= u[0]["ts"] and \
                o[0]["ts"] + o[0]["dur"] >= u[0]["ts"] + u[0]["dur"], (o[0], u[0])
PY
echo "watchdog.sh: PASS ($mode): exit $rc after ${took} s"
