#!/usr/bin/env python3
"""Checks on dt_train step logs (--train.log-file: one JSON object per line, rank 0).

  steplog.py steps FILE FIRST LAST
      FILE holds exactly the steps FIRST..LAST, once each, in order.
  steplog.py same A B FIRST LAST [RTOL]
      for every step FIRST..LAST: A and B both have it, "loss" and "lr" agree within RTOL
      (relative, default 1e-5), and "val_loss" is in both or in neither and agrees too;
      "loss_scale" and "skipped" (mixed precision), where both have them, are equal.
  steplog.py value FILE STEP KEY
      prints the KEY of STEP.
  steplog.py close X Y RTOL
      two numbers agree within RTOL (relative).
"""
import json
import math
import sys


def load(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                sys.exit(f"steplog.py: {path}:{n}: not JSON ({e}): {line!r}")
    return rows


def by_step(path):
    out = {}
    for r in load(path):
        if "step" not in r:
            sys.exit(f"steplog.py: {path}: a line without \"step\": {r}")
        if r["step"] in out:
            sys.exit(f"steplog.py: {path}: step {r['step']} appears twice")
        out[r["step"]] = r
    return out


def close(x, y, rtol):
    if not (math.isfinite(x) and math.isfinite(y)):
        return False
    return abs(x - y) <= rtol * max(abs(x), abs(y), 1e-30)


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    cmd = argv[1]
    if cmd == "steps":
        path, first, last = argv[2], int(argv[3]), int(argv[4])
        got = [r.get("step") for r in load(path)]
        want = list(range(first, last + 1))
        if got != want:
            sys.exit(f"steplog.py: {path} has steps {got}, expected {want}")
        print(f"steplog.py: {path}: steps {first}..{last}")
        return
    if cmd == "same":
        a, b, first, last = argv[2], argv[3], int(argv[4]), int(argv[5])
        rtol = float(argv[6]) if len(argv) > 6 else 1e-5
        ra, rb = by_step(a), by_step(b)
        bad = []
        for s in range(first, last + 1):
            if s not in ra or s not in rb:
                bad.append(f"step {s}: in {a}: {s in ra}, in {b}: {s in rb}")
                continue
            for k in ("loss", "lr", "val_loss"):
                if (k in ra[s]) != (k in rb[s]):
                    bad.append(f"step {s}: '{k}' in {a}: {k in ra[s]}, in {b}: {k in rb[s]}")
                elif k in ra[s] and not close(float(ra[s][k]), float(rb[s][k]), rtol):
                    bad.append(f"step {s}: {k} {ra[s][k]!r} vs {rb[s][k]!r} (rtol {rtol})")
            for k in ("loss_scale", "skipped"):
                if k in ra[s] and k in rb[s] and ra[s][k] != rb[s][k]:
                    bad.append(f"step {s}: {k} {ra[s][k]!r} vs {rb[s][k]!r}")
        if bad:
            sys.exit("steplog.py: " + a + " and " + b + " differ:\n  " + "\n  ".join(bad))
        print(f"steplog.py: {a} and {b} agree on steps {first}..{last} (rtol {rtol})")
        return
    if cmd == "value":
        path, step, key = argv[2], int(argv[3]), argv[4]
        r = by_step(path).get(step)
        if r is None or key not in r:
            sys.exit(f"steplog.py: {path}: no {key} at step {step}")
        print(repr(float(r[key])))
        return
    if cmd == "close":
        x, y, rtol = float(argv[2]), float(argv[3]), float(argv[4])
        if not close(x, y, rtol):
            sys.exit(f"steplog.py: {x!r} and {y!r} differ by more than {rtol} (relative)")
        print(f"steplog.py: {x!r} ~ {y!r} (rtol {rtol})")
        return
    sys.exit(f"steplog.py: unknown command {cmd!r}\n{__doc__}")


if __name__ == "__main__":
    main(sys.argv)
