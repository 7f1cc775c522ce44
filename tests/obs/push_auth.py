#!/usr/bin/env python3
"""obs.pushgateway_auth: a real prometheus-pushgateway behind basic authentication (its
--web.config.file with a bcrypt hash). dt_train given --metrics.push-auth-file (USER:PASSWORD in a
private file) pushes to it; without the file every push is refused (HTTP 401: one warning, the run
goes on). Credentials in --metrics.push-url are refused before training without being repeated,
as is an auth file that others can read or that holds no USER:PASSWORD line."""
import base64
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import warnings

import obslib
from obslib import check, fail

a = obslib.Args(sys.argv)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import crypt  # bcrypt hashes through the C library (the gateway reads no other kind)

gw_bin = shutil.which("prometheus-pushgateway") or "/usr/bin/prometheus-pushgateway"
if not os.path.exists(gw_bin):
    fail("prometheus-pushgateway is not installed (scripts/bootstrap installs it)")
    obslib.finish(a)

user, password = "dt-job", "s3cret-%d" % os.getpid()
with open("web.yml", "w") as f:
    f.write("basic_auth_users:\n  %s: %s\n" %
            (user, crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))))


def private_file(name, text, mode=0o600):
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(name, mode)
    return os.path.abspath(name)


auth = private_file("auth", "%s:%s\n" % (user, password))
port = obslib.free_port()
base = "http://127.0.0.1:%d" % port
gw = subprocess.Popen([gw_bin, "--web.listen-address=127.0.0.1:%d" % port,
                       "--web.config.file=web.yml"],
                      stdout=open("pushgateway.log", "w"), stderr=subprocess.STDOUT,
                      start_new_session=True)
header = {"Authorization": "Basic " + base64.b64encode(("%s:%s" % (user, password)).encode()).decode()}


def get(path):
    try:
        with urllib.request.urlopen(urllib.request.Request(base + path, headers=header),
                                    timeout=5) as r:
            return r.status, r.read().decode()
    except Exception as e:  # noqa: BLE001 (any failure: not ready)
        return 0, str(e)


try:
    if obslib.gateway_ready(gw, lambda: get("/-/ready"), base):
        check(obslib.http_get(base + "/metrics")[0] == 401, "the gateway answers without credentials")
        env = dict(os.environ, SLURM_JOB_ID="auth%d" % os.getpid())
        rc, out = obslib.run(a.train_cmd(1, "--train.steps=3", "--metrics.every=1",
                                         "--metrics.push-url=" + base,
                                         "--metrics.push-timeout-s=30",
                                         "--metrics.push-auth-file=" + auth), env=env)
        check(rc == 0 and "warning" not in out, "with the auth file: exit code %s, %s" % (rc, out))
        status, body = get("/metrics")
        samples = obslib.parse_prometheus(body)[2] if status == 200 else []
        step = obslib.value_of(samples, "dt_train_step", job=env["SLURM_JOB_ID"], instance="0")
        check(step == 3, "the gateway holds dt_train_step %s for the job, expected 3" % step)
        check(password not in out, "the password was printed")

        rc, out = obslib.run(a.train_cmd(1, "--train.steps=3", "--metrics.every=1",
                                         "--metrics.push-url=" + base), env=env)
        warned = [l for l in out.splitlines() if "warning: metrics push to" in l]
        check(rc == 0 and len(warned) == 1 and "HTTP 401" in warned[0],
              "without the auth file: exit code %s, push warnings %s" % (rc, warned))
finally:
    obslib.stop_process_group(gw)
    gw.wait()

# Refused before training, exit 2, the password never repeated.
url = "http://%s:%s@127.0.0.1:%d" % (user, password, port)
rc, out = obslib.run(a.train_cmd(1, "--metrics.push-url=" + url))
check(rc == 2 and "is given with credentials" in out and "--metrics.push-auth-file" in out,
      "credentials in the URL: exit code %s" % rc)
check(password not in out, "the URL's password was printed")
rc, out = obslib.run(a.train_cmd(1, "--metrics.push-url=https://%s:%s@gw.example:9091" % (user, password)))
check(rc == 2 and "https://gw.example:9091 is given with credentials" in out and password not in out,
      "credentials in an https URL: exit code %s" % rc)
# A password with a '/' (where the host part seemed to end).
rc, out = obslib.run(a.train_cmd(1, "--metrics.push-url=http://%s:pa/%s@gw.example:9091" % (user, password)))
check(rc == 2 and "http://gw.example:9091 is given with credentials" in out and password not in out,
      "credentials with a '/' in the password: exit code %s" % rc)
loose = private_file("loose", "%s:%s\n" % (user, password), 0o644)
rc, out = obslib.run(a.train_cmd(1, "--metrics.push-url=" + base, "--metrics.push-auth-file=" + loose))
check(rc == 2 and "has mode 0644" in out and "metrics.push-auth-file" in out,
      "an auth file others can read: exit code %s" % rc)
bad = private_file("bad", password + "\n")
rc, out = obslib.run(a.train_cmd(1, "--metrics.push-url=" + base, "--metrics.push-auth-file=" + bad))
check(rc == 2 and "must hold one line USER:PASSWORD" in out and password not in out,
      "an auth file without USER:PASSWORD: exit code %s" % rc)
rc, out = obslib.run(a.train_cmd(1, "--metrics.push-auth-file=" + auth))
check(rc == 2 and "--metrics.push-auth-file is given without --metrics.push-url" in out,
      "an auth file without a push URL: exit code %s" % rc)
obslib.finish(a)
