"""Helpers of the observability end-to-end tests (standard library only).

Every test script is called as
    SCRIPT WORKDIR DT_TRAIN DT_TRACE CONFIG TEXT MPIEXEC...
WORKDIR is the test's own directory (emptied first, removed at the end unless DT_KEEP_TEST_DIR is
set in the environment). A script prints what it does, collects failures with fail() and ends
with finish(), which exits 1 when anything failed.
"""

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

FAILED = []


def fail(msg):
    print("FAIL: " + msg, flush=True)
    FAILED.append(msg)


def check(cond, msg):
    if not cond:
        fail(msg)
    return cond


class Args:
    def __init__(self, argv):
        if len(argv) < 7:
            print("usage: %s WORKDIR DT_TRAIN DT_TRACE CONFIG TEXT MPIEXEC..." % argv[0])
            sys.exit(2)
        self.work, self.train, self.trace, self.config, self.text = argv[1:6]
        self.mpiexec = argv[6:]
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        os.chdir(self.work)

    def train_cmd(self, ranks, *options):
        return (self.mpiexec + ["-n", str(ranks), self.train, "--config", self.config,
                                "--data.path=" + self.text] + list(options))


def finish(args):
    name = os.path.basename(sys.argv[0])
    if os.environ.get("DT_KEEP_TEST_DIR"):
        print("(kept %s)" % args.work)
    else:
        os.chdir("/")
        shutil.rmtree(args.work, ignore_errors=True)
    if FAILED:
        print("%s: FAIL (%d problems)" % (name, len(FAILED)), flush=True)
        sys.exit(1)
    print("%s: PASS" % name, flush=True)
    sys.exit(0)


def run(cmd, timeout=120, env=None):
    """Runs cmd to the end; returns (exit code, combined output). Prints both."""
    print("=== " + " ".join(cmd), flush=True)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                           env=env, text=True, start_new_session=True)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = None
        fail("timed out after %d s: %s" % (timeout, " ".join(cmd)))
    for line in out.splitlines():
        print("    " + line)
    print("=== exit code %s after %.1f s" % (rc, time.time() - t0), flush=True)
    return rc, out


def gateway_ready(proc, probe, what, log="pushgateway.log"):
    """Waits up to 30 s for probe() to give 200 while proc runs; checks that it did (printing
    the log otherwise) and returns whether it did."""
    ready = False
    for _ in range(300):
        if proc.poll() is not None:
            break
        if probe()[0] == 200:
            ready = True
            break
        time.sleep(0.1)
    if not check(ready, "the pushgateway did not become ready on %s" % what):
        print(open(log).read())
    return ready


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http_get(url, timeout=10):
    """(status, body); status 0 when the connection itself failed."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, ConnectionError, socket.timeout) as e:
        return 0, str(e)


# ---- Prometheus text exposition format 0.0.4 ----------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(r"^(%s)(\{.*\})? (\S+)( -?\d+)?$" % _NAME)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


class ParseError(Exception):
    pass


def _unescape(v, line):
    out, i = [], 0
    while i < len(v):
        if v[i] == "\\":
            nxt = v[i + 1]
            if nxt == "n":
                out.append("\n")
            elif nxt in "\\\"":
                out.append(nxt)
            else:
                raise ParseError("bad escape: " + line)
            i += 2
        else:
            out.append(v[i])
            i += 1
    return "".join(out)


def _labels(text, line):
    out = {}
    body = text[1:-1]
    pos = 0
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if not m:
            raise ParseError("bad label set: " + line)
        k, v = m.group(1), _unescape(m.group(2), line)
        if k in out:
            raise ParseError("label twice: " + line)
        out[k] = v
        pos = m.end()
    return out


def _value(text, line):
    if text in ("+Inf", "Inf"):
        return math.inf
    if text == "-Inf":
        return -math.inf
    if text == "NaN":
        return math.nan
    try:
        return float(text)
    except ValueError:
        raise ParseError("bad value: " + line)


def parse_prometheus(text):
    """Parses every line strictly. Returns (types, helps, samples); samples are
    (name, labels dict, value). Raises ParseError naming the line."""
    types, helps, samples = {}, {}, []
    family = None
    if text and not text.endswith("\n"):
        raise ParseError("no newline at the end")
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] == "HELP":
                if not re.fullmatch(_NAME, parts[2]):
                    raise ParseError("bad name: " + line)
                if parts[2] in helps:
                    raise ParseError("second HELP: " + line)
                helps[parts[2]] = parts[3] if len(parts) > 3 else ""
            elif len(parts) == 4 and parts[1] == "TYPE":
                if parts[3] not in ("counter", "gauge", "histogram", "summary", "untyped"):
                    raise ParseError("bad type: " + line)
                if parts[2] in types:
                    raise ParseError("second TYPE: " + line)
                types[parts[2]] = parts[3]
                family = parts[2]
            continue  # other comments are allowed by the format
        if not line.strip():
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ParseError("not a sample: " + line)
        name = m.group(1)
        labels = _labels(m.group(2), line) if m.group(2) else {}
        value = _value(m.group(3), line)
        base = name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and types.get(name[: -len(suffix)]) == "histogram":
                base = name[: -len(suffix)]
        if base in types and base != family:
            raise ParseError("sample of %s outside its family block: %s" % (base, line))
        samples.append((name, labels, value))
    return types, helps, samples


def check_histograms(types, samples, where):
    """Every histogram series: buckets cumulative, +Inf bucket == _count, _sum present."""
    for fam, t in types.items():
        if t != "histogram":
            continue
        series = {}
        for name, labels, value in samples:
            key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            if name == fam + "_bucket":
                series.setdefault(key, {}).setdefault("buckets", []).append(
                    (_value(labels["le"], name), value))
            elif name == fam + "_count":
                series.setdefault(key, {})["count"] = value
            elif name == fam + "_sum":
                series.setdefault(key, {})["sum"] = value
        for key, s in series.items():
            b = sorted(s.get("buckets", []))
            ok = (b and b[-1][0] == math.inf and "count" in s and "sum" in s and
                  all(b[i][1] <= b[i + 1][1] for i in range(len(b) - 1)) and
                  b[-1][1] == s["count"])
            check(ok, "%s: histogram %s%s is inconsistent: %s" % (where, fam, dict(key), s))


def value_of(samples, name, **labels):
    hits = [v for n, l, v in samples if n == name and all(l.get(k) == v2 for k, v2 in labels.items())]
    return hits[0] if len(hits) == 1 else None


def stop_process_group(p, sig=signal.SIGKILL):
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
