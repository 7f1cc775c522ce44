#!/usr/bin/env python3
"""obs.http_scrape: a 2-rank dt_train with --metrics.port=-1 prints where each rank serves
/metrics; while it trains, both endpoints are scraped with a real HTTP client (urllib) and every
line is parsed. The values must make sense (step counter moving, finite loss, positive tokens/s,
consistent histograms, resident memory), another path is a 404, and after a drain (SIGUSR1 to
mpiexec) the job exits 76 (drained, no ckpt.dir to save in) and the endpoints are gone. Clients
that connect and never finish a request neither keep a scrape from its answer nor hold the exit,
and those that trickle their request are closed at --metrics.request-deadline-s."""
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import obslib
from obslib import check, fail

a = obslib.Args(sys.argv)
# --metrics.request-deadline-s: a connection that trickles its request is closed this long after
# it was taken up (the default is 5 s).
DEADLINE_S = 1.5
cmd = a.train_cmd(2, "--train.steps=1000000", "--train.log-every=1000000", "--train.eval-every=0",
                  "--metrics.port=-1", "--metrics.host=127.0.0.1",
                  "--metrics.request-deadline-s=%g" % DEADLINE_S)
# The job trains without end. Both ranks share one core (Open MPI's waiting ranks yield it), and
# this script runs on the others: with a rank busy on every core of a 2-core machine, this
# script and the kernel's own workers were seen to get no CPU for 40 s and more (dmesg:
# "workqueue lockup"), and the scrapes timed out.
env = dict(os.environ)
cpus = sorted(os.sched_getaffinity(0))
job_cpus = set(cpus)
if len(cpus) >= 2:
    job_cpus = {cpus[0]}
    cmd = a.mpiexec + ["--bind-to", "none"] + cmd[len(a.mpiexec):]
    env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    os.sched_setaffinity(0, cpus[1:])
print("=== in the background, on CPU(s) %s: %s" % (sorted(job_cpus), " ".join(cmd)), flush=True)
out = open("train.out", "w")
job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                       preexec_fn=lambda: os.sched_setaffinity(0, job_cpus))
urls = {}
rc = None
try:
    deadline = time.time() + 90
    while time.time() < deadline and len(urls) < 2 and job.poll() is None:
        for m in re.finditer(r"rank (\d+): metrics at (http://\S+/metrics)", open("train.out").read()):
            urls[int(m.group(1))] = m.group(2)
        time.sleep(0.1)
    check(sorted(urls) == [0, 1], "expected 'metrics at' lines of ranks 0 and 1, got %s" % urls)
    check(len(set(urls.values())) == len(urls), "two ranks share one endpoint: %s" % urls)

    first_step = {}
    for rank, url in sorted(urls.items()):
        # Scrape until this rank has taken a few steps (or the job ends, which it must not).
        steps_seen = []
        while time.time() < deadline and job.poll() is None:
            status, body = obslib.http_get(url)
            if not check(status == 200, "rank %d: GET %s: status %s: %s" % (rank, url, status, body[:200])):
                break
            try:
                types, helps, samples = obslib.parse_prometheus(body)
            except obslib.ParseError as e:
                fail("rank %d: %s" % (rank, e))
                break
            step = obslib.value_of(samples, "dt_train_step")
            steps_seen.append(step)
            if step is not None and step >= 3:
                break
            time.sleep(0.05)
        check(job.poll() is None, "the job ended while rank %d was being scraped" % rank)
        print("rank %d: %s: %d lines, steps seen %s" % (rank, url, len(body.splitlines()),
                                                      steps_seen[:3] + ["..."] + steps_seen[-2:]))
        if not steps_seen or steps_seen[-1] is None:
            fail("rank %d: no dt_train_step sample" % rank)
            continue
        first_step[rank] = steps_seen[-1]
        for fam in types:
            check(fam in helps, "rank %d: %s has a TYPE but no HELP line" % (rank, fam))
        for name, labels, v in samples:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            check(name in types or base in types, "rank %d: sample %s has no TYPE" % (rank, name))
        obslib.check_histograms(types, samples, "rank %d" % rank)
        expect_types = {"dt_train_step": "gauge", "dt_train_loss": "gauge",
                        "dt_train_learning_rate": "gauge", "dt_train_grad_norm": "gauge",
                        "dt_train_loss_scale": "gauge", "dt_train_tokens_per_second": "gauge",
                        "dt_train_model_flops_utilization": "gauge",
                        "dt_train_tokens_total": "counter", "dt_train_step_seconds": "histogram",
                        "dt_process_resident_bytes": "gauge", "dt_ckpt_saves_total": "counter"}
        for fam, t in expect_types.items():
            check(types.get(fam) == t, "rank %d: %s has type %s, expected %s" % (rank, fam, types.get(fam), t))
        v = lambda n, **l: obslib.value_of(samples, n, **l)
        loss = v("dt_train_loss")
        check(loss is not None and math.isfinite(loss) and 0 < loss < 10, "rank %d: loss %s" % (rank, loss))
        check((v("dt_train_learning_rate") or 0) > 0, "rank %d: learning rate %s" % (rank, v("dt_train_learning_rate")))
        check(v("dt_train_loss_scale") == 1, "rank %d: loss scale %s" % (rank, v("dt_train_loss_scale")))
        check((v("dt_train_tokens_per_second") or 0) > 0, "rank %d: tokens/s %s" % (rank, v("dt_train_tokens_per_second")))
        mfu = v("dt_train_model_flops_utilization")
        check(mfu is not None and 0 < mfu < 1, "rank %d: model FLOP utilisation %s" % (rank, mfu))
        steps = v("dt_train_step")
        # Tokens and the step-time histogram cover the steps taken (the scrape may fall between
        # the updates of one step: allow one step of difference).
        check(abs(v("dt_train_tokens_total") - steps * 8 * 32) <= 8 * 32,
              "rank %d: tokens_total %s after %s steps" % (rank, v("dt_train_tokens_total"), steps))
        check(abs(v("dt_train_step_seconds_count") - steps) <= 1,
              "rank %d: step_seconds_count %s after %s steps" % (rank, v("dt_train_step_seconds_count"), steps))
        check((v("dt_process_resident_bytes") or 0) > 1e6, "rank %d: resident bytes %s" % (rank, v("dt_process_resident_bytes")))
        check((v("dt_process_max_resident_bytes") or 0) >= (v("dt_process_resident_bytes") or 0),
              "rank %d: resident peak %s below current %s" % (rank, v("dt_process_max_resident_bytes"), v("dt_process_resident_bytes")))
        # parameters, gradients (unless in the shared arena), moments and activations of micro
        check((v("dt_device_allocated_bytes") or 0) > 4 * 34688 * 3, "rank %d: device bytes %s" % (rank, v("dt_device_allocated_bytes")))
        check((v("dt_device_max_allocated_bytes") or 0) >= (v("dt_device_allocated_bytes") or 0), "rank %d: device peak below current" % rank)
        check(v("dt_world_size") == 2, "rank %d: world size %s" % (rank, v("dt_world_size")))
        # The communication layer reports every collective through dt::metrics::record_comm.
        comm = [(l, val) for n, l, val in samples if n == "dt_comm_calls_total"]
        check(types.get("dt_comm_calls_total") == "counter" and
              any(val >= steps and set(l) == {"op", "backend"} for l, val in comm),
              "rank %d: no dt_comm_calls_total{op,backend} counting the step's collectives: %s" % (rank, comm))
        check(any(val > 0 for n, l, val in samples if n == "dt_comm_bytes_total"),
              "rank %d: dt_comm_bytes_total is missing or 0" % rank)
        status, _ = obslib.http_get(url.replace("/metrics", "/nope"))
        check(status == 404, "rank %d: GET /nope gave %s, expected 404" % (rank, status))

    # A later scrape shows the job moving on.
    if 0 in urls and 0 in first_step:
        moved = False
        while time.time() < deadline and job.poll() is None and not moved:
            status, body = obslib.http_get(urls[0])
            if status == 200:
                moved = obslib.value_of(obslib.parse_prometheus(body)[2], "dt_train_step") > first_step[0]
            time.sleep(0.05)
        check(moved, "rank 0: dt_train_step did not move past %s" % first_step[0])

    # Clients that connect and never finish a request: two that say nothing and five that send
    # a byte every 0.5 s for as long as the test runs (more than the four threads that served all
    # connections once). A scrape still gets its answer, and they do not hold the exit after the
    # drain, which they did for as long as they kept the connection: from the drained line to the
    # exit within 8 s (about 1 s without them, and the exporter waits 1 s for its server's
    # connections).
    held = []
    trickling = threading.Event()
    if 0 in urls:
        host, port = re.match(r"http://\[?([^\]/]+?)\]?:(\d+)/", urls[0]).groups()
        for _ in range(2):
            held.append(socket.create_connection((host, int(port)), timeout=5))

        closed_after = []

        def trickle():
            try:
                c = socket.create_connection((host, int(port)), timeout=5)
                t = time.time()
                held.append(c)
                c.sendall(b"GET /metrics HTTP/1.1\r\n")
                while not trickling.wait(0.5):
                    c.sendall(b"X")
            except OSError:  # the server closed it: a send after its close fails
                closed_after.append(time.time() - t)

        for _ in range(5):
            threading.Thread(target=trickle, daemon=True).start()
        time.sleep(0.5)
        t0 = time.time()
        status, body = obslib.http_get(urls[0], timeout=10)
        check(status == 200 and time.time() - t0 < 3,
              "rank 0: a scrape with 7 clients holding connections: status %s after %.1f s"
              % (status, time.time() - t0))
        # The five trickling clients are closed at the deadline (each was taken up at once: the
        # server has threads for 32 connections), detected by the second send after the close.
        t0 = time.time()
        while len(closed_after) < 5 and time.time() - t0 < 4 * DEADLINE_S + 5:
            time.sleep(0.1)
        check(len(closed_after) == 5 and max(closed_after) < 2 * DEADLINE_S + 1.5,
              "rank 0: trickling clients closed after %s s, expected all within %.1f s "
              "(--metrics.request-deadline-s=%g, twice, and two sends)"
              % (sorted(round(x, 1) for x in closed_after), 2 * DEADLINE_S + 1.5, DEADLINE_S))
    print("=== drain: SIGUSR1 to mpiexec (pid %d)" % job.pid, flush=True)
    job.send_signal(signal.SIGUSR1)
    drained_at = None
    try:
        deadline = time.time() + 60
        while job.poll() is None and time.time() < deadline:
            if drained_at is None and "drained at step" in open("train.out").read():
                drained_at = time.time()
            time.sleep(0.05)
        rc = job.wait(timeout=max(1, deadline - time.time()))
        end = time.time()
        check(drained_at is not None, "no 'drained at step' line before the exit")
        if drained_at is None:
            drained_at = end
        check(end - drained_at < 8,
              "the exit came %.1f s after the drained line: clients holding connections "
              "held it" % (end - drained_at))
    except subprocess.TimeoutExpired:
        rc = None
        fail("the job did not drain within 60 s")
    trickling.set()
    for c in held:
        c.close()
finally:
    if job.poll() is None:
        obslib.stop_process_group(job)
        job.wait()
    out.close()
print(open("train.out").read(), flush=True)
check(rc == 76, "exit code %s after the drain, expected 76 (no ckpt.dir)" % rc)
for rank, url in sorted(urls.items()):
    status, _ = obslib.http_get(url, timeout=2)
    check(status == 0, "rank %d: %s still answers (%s) after the job ended" % (rank, url, status))
obslib.finish(a)
