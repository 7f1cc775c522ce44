#!/usr/bin/env python3
"""Independent safetensors reader/writer for the dt_ckpt tests (standard library only).

  st_tool.py check-export ST CKPT STEP WORK   ST must be a well-formed safetensors file holding
                                              exactly the /model datasets of CKPT (plus lm_head.weight
                                              = transformer.wte.weight), byte for byte as h5dump
                                              reads them, with __metadata__ format=pt, step=STEP
  st_tool.py same-model CKPT_A CKPT_B WORK    the /model datasets of both checkpoints are the same
                                              names, shapes and bytes; /optim of CKPT_B is all zero
  st_tool.py to-half IN OUT EXPECT            rewrites the F32 file IN with F16/BF16 tensors as OUT
                                              and writes the exact float32 values dt must import
                                              to EXPECT/<name>.bin
  st_tool.py match-expected CKPT EXPECT WORK  /model/<name> of CKPT equals EXPECT/<name>.bin
  st_tool.py make KIND OUT                    a small nanoGPT model (vocab 8, seq 4, 2 layers,
                                              embd 4), valid or with the defect KIND

Exits 0 when the check holds, 1 with a message otherwise. h5dump and h5ls come from PATH.
"""
import json
import os
import random
import re
import struct
import subprocess
import sys


def fail(msg):
    print("st_tool.py: FAIL: " + msg)
    sys.exit(1)


def read_st(path):
    data = open(path, "rb").read()
    if len(data) < 8:
        fail(f"{path}: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        fail(f"{path}: header length {n} > file size {len(data)}")
    if n % 8 != 0:
        fail(f"{path}: header length {n} is not a multiple of 8")
    raw = data[8:8 + n]
    if raw.rstrip(b" ") != raw.rstrip():
        fail(f"{path}: header padding is not spaces")
    header = json.loads(raw.decode("utf-8"))
    if not isinstance(header, dict):
        fail(f"{path}: header is not an object")
    return header, data[8 + n:]


def tensors_of(header):
    return {k: v for k, v in header.items() if k != "__metadata__"}


def write_st(path, tensors, metadata=None, header_len=None, header_text=None):
    """tensors: list of (name, dtype, shape, bytes) in data order."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    off = 0
    for name, dtype, shape, blob in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(blob)]}
        off += len(blob)
    text = header_text if header_text is not None else json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", header_len if header_len is not None else len(text)))
        f.write(text)
        for _, _, _, blob in tensors:
            f.write(blob)


def h5_datasets(ckpt, group):
    """{name: shape} of the datasets directly under `group` (h5ls -r)."""
    out = subprocess.run(["h5ls", "-r", ckpt + group], capture_output=True, text=True)
    if out.returncode != 0:
        fail(f"h5ls {ckpt}{group}: {out.stderr}")
    result = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^/?(\S+)\s+Dataset \{([^}]*)\}", line)
        if m:
            dims = [int(d.split("/")[0]) for d in m.group(2).split(",") if d.strip()]
            result[m.group(1)] = dims
    return result


def h5_bytes(ckpt, dataset, work):
    os.makedirs(work, exist_ok=True)
    out = os.path.join(work, "h5dump.bin")
    if os.path.exists(out):
        os.remove(out)
    r = subprocess.run(["h5dump", "-d", dataset, "-b", "LE", "-o", out, ckpt],
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"h5dump -d {dataset} {ckpt}: {r.stdout}{r.stderr}")
    return open(out, "rb").read()


def check_export(st, ckpt, step, work):
    header, data = read_st(st)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != "pt":
        fail(f"__metadata__ lacks format=pt: {meta}")
    if meta.get("step") != step:
        fail(f"__metadata__ step is {meta.get('step')!r}, expected {step!r}")
    if not all(isinstance(v, str) for v in meta.values()):
        fail("__metadata__ values must be strings")
    ts = tensors_of(header)
    model = h5_datasets(ckpt, "/model")
    if not model:
        fail(f"no /model datasets found in {ckpt}")
    want = set(model) | {"lm_head.weight"}
    if set(ts) != want:
        fail(f"tensor names differ: extra {sorted(set(ts) - want)}, missing {sorted(want - set(ts))}")
    # Data: tensors in sorted name order, contiguous, covering the data section exactly.
    off = 0
    for name in sorted(ts):
        t = ts[name]
        b, e = t["data_offsets"]
        if b != off:
            fail(f"{name}: data_offsets {t['data_offsets']} do not follow the previous tensor (at {off})")
        n = 1
        for d in t["shape"]:
            n *= d
        if t["dtype"] != "F32" or e - b != 4 * n:
            fail(f"{name}: dtype {t['dtype']} shape {t['shape']} does not fit {e - b} bytes")
        off = e
    if off != len(data):
        fail(f"data section has {len(data)} bytes, tensors cover {off}")
    for name, shape in model.items():
        t = ts[name]
        if t["shape"] != shape:
            fail(f"{name}: shape {t['shape']}, HDF5 has {shape}")
        b, e = t["data_offsets"]
        if data[b:e] != h5_bytes(ckpt, "/model/" + name, work):
            fail(f"{name}: bytes differ from /model/{name} of {ckpt}")
    wte, head = ts["transformer.wte.weight"], ts["lm_head.weight"]
    if head["shape"] != wte["shape"] or \
            data[slice(*head["data_offsets"])] != data[slice(*wte["data_offsets"])]:
        fail("lm_head.weight differs from transformer.wte.weight")
    print(f"st_tool.py: PASS: {len(ts)} tensors of {st} match {ckpt} byte for byte, "
          f"lm_head.weight = transformer.wte.weight")


def same_model(a, b, work):
    ma, mb = h5_datasets(a, "/model"), h5_datasets(b, "/model")
    if not ma or ma != mb:
        fail(f"/model datasets differ: {sorted(ma.items())} vs {sorted(mb.items())}")
    for name in ma:
        if h5_bytes(a, "/model/" + name, work) != h5_bytes(b, "/model/" + name, work):
            fail(f"/model/{name} differs between {a} and {b}")
    for group in ("/optim/exp_avg", "/optim/exp_avg_sq"):
        ob = h5_datasets(b, group)
        if set(ob) != set(ma):
            fail(f"{group} of {b} has {sorted(ob)}, expected the model's names")
        for name in ob:
            if any(h5_bytes(b, f"{group}/{name}", work)):
                fail(f"{group}/{name} of {b} is not all zero")
    print(f"st_tool.py: PASS: {len(ma)} /model datasets identical, optimiser moments of {b} zero")


def to_half(src, dst, expect):
    header, data = read_st(src)
    ts = tensors_of(header)
    os.makedirs(expect, exist_ok=True)
    out = []
    for i, name in enumerate(sorted(ts)):
        t = ts[name]
        vals = struct.unpack(f"<{(t['data_offsets'][1] - t['data_offsets'][0]) // 4}f",
                             data[slice(*t["data_offsets"])])
        # wte and lm_head both BF16 (so they stay equal), wpe F16, the rest alternating.
        use_bf16 = name in ("transformer.wte.weight", "lm_head.weight") or \
            (name != "transformer.wpe.weight" and i % 2 == 0)
        if use_bf16:
            bits = []
            for v in vals:
                (u,) = struct.unpack("<I", struct.pack("<f", v))
                u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # nearest even (no NaN in weights)
                bits.append(u)
            blob = struct.pack(f"<{len(bits)}H", *bits)
            exact = struct.pack(f"<{len(bits)}I", *[b << 16 for b in bits])
            dtype = "BF16"
        else:
            blob = struct.pack(f"<{len(vals)}e", *vals)
            exact = struct.pack(f"<{len(vals)}f", *struct.unpack(f"<{len(vals)}e", blob))
            dtype = "F16"
        out.append((name, dtype, t["shape"], blob))
        with open(os.path.join(expect, name + ".bin"), "wb") as f:
            f.write(exact)
    write_st(dst, out, {"format": "pt"})
    kinds = sorted({d for _, d, _, _ in out})
    print(f"st_tool.py: wrote {dst} ({len(out)} tensors, {', '.join(kinds)})")


def match_expected(ckpt, expect, work):
    model = h5_datasets(ckpt, "/model")
    if not model:
        fail(f"no /model datasets in {ckpt}")
    for name in model:
        want = open(os.path.join(expect, name + ".bin"), "rb").read()
        if h5_bytes(ckpt, "/model/" + name, work) != want:
            fail(f"/model/{name} of {ckpt} is not the exact float32 of the 16-bit input")
    print(f"st_tool.py: PASS: {len(model)} tensors converted exactly")


def small_model():
    V, T, L, C = 8, 4, 2, 4
    shapes = [("transformer.wte.weight", [V, C]), ("transformer.wpe.weight", [T, C])]
    for l in range(L):
        h = f"transformer.h.{l}."
        shapes += [(h + "ln_1.weight", [C]), (h + "ln_1.bias", [C]),
                   (h + "attn.c_attn.weight", [3 * C, C]), (h + "attn.c_attn.bias", [3 * C]),
                   (h + "attn.c_proj.weight", [C, C]), (h + "attn.c_proj.bias", [C]),
                   (h + "ln_2.weight", [C]), (h + "ln_2.bias", [C]),
                   (h + "mlp.c_fc.weight", [4 * C, C]), (h + "mlp.c_fc.bias", [4 * C]),
                   (h + "mlp.c_proj.weight", [C, 4 * C]), (h + "mlp.c_proj.bias", [C])]
    shapes += [("transformer.ln_f.weight", [C]), ("transformer.ln_f.bias", [C])]
    rnd = random.Random(7)
    out = []
    for name, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        out.append((name, "F32", shape, struct.pack(f"<{n}f", *[rnd.gauss(0, 0.02) for _ in range(n)])))
    return out


def make(kind, path):
    ts = small_model()
    meta = {"format": "pt"}
    if kind == "valid":
        write_st(path, ts, meta)
    elif kind == "header_too_long":
        write_st(path, ts, meta)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(struct.pack("<Q", size + 100))
    elif kind == "missing_tensor":
        write_st(path, [t for t in ts if t[0] != "transformer.h.1.mlp.c_fc.bias"], meta)
    elif kind == "bad_json":
        write_st(path, ts, meta, header_text=b'{"transformer.wte.weight": {"dtype": "F32",')
    elif kind == "offsets_out_of_range":
        write_st(path, ts, meta)
        header, data = read_st(path)
        header["transformer.ln_f.bias"]["data_offsets"][1] += 4
        header["transformer.ln_f.bias"]["data_offsets"][0] += 4
        text = json.dumps(header).encode()
        write_st(path, [("x", "F32", [len(data) // 4], data)], header_text=text)
    elif kind == "overlap":
        write_st(path, ts, meta)
        header, data = read_st(path)
        header["transformer.wpe.weight"]["data_offsets"] = header["transformer.wte.weight"]["data_offsets"][:]
        header["transformer.wpe.weight"]["shape"] = [8, 4]
        text = json.dumps(header).encode()
        write_st(path, [("x", "F32", [len(data) // 4], data)], header_text=text)
    elif kind == "unknown_dtype":
        ts[3] = (ts[3][0], "Q4", ts[3][2], ts[3][3])
        write_st(path, ts, meta)
    elif kind == "shape_mismatch":
        ts[4] = (ts[4][0], "F32", [4, 12], ts[4][3])  # transformer.h.0.attn.c_attn.weight, is [12, 4]
        write_st(path, ts, meta)
    elif kind == "inf_weight":  # transformer.h.1.mlp.c_fc.weight, element 5: +Inf
        name, dtype, shape, data = next(t for t in ts if t[0] == "transformer.h.1.mlp.c_fc.weight")
        data = data[:20] + struct.pack("<f", float("inf")) + data[24:]
        ts = [(n, d, s, data if n == name else b) for n, d, s, b in ts]
        write_st(path, ts, meta)
    elif kind == "stray_layer":  # one tensor of a layer a million away from the others
        write_st(path, ts + [("transformer.h.999999.x", "F32", [1], struct.pack("<f", 1.0))], meta)
    elif kind == "many_mismatched":  # every layer tensor of 2 layers (24) flattened to [1, numel]
        ts = [(n, d, [1, len(b) // 4] if n.startswith("transformer.h.") else sh, b)
              for n, d, sh, b in ts]
        write_st(path, ts, meta)
    elif kind == "lm_head_differs":
        wte = ts[0]
        other = struct.pack("<32f", *[0.5] * 32)
        write_st(path, ts + [("lm_head.weight", "F32", wte[2], other)], meta)
    else:
        fail(f"unknown kind {kind}")
    print(f"st_tool.py: wrote {path} ({kind})")


def main(argv):
    if len(argv) < 2:
        fail(__doc__)
    cmd, args = argv[1], argv[2:]
    if cmd == "check-export" and len(args) == 4:
        check_export(*args)
    elif cmd == "same-model" and len(args) == 3:
        same_model(*args)
    elif cmd == "to-half" and len(args) == 3:
        to_half(*args)
    elif cmd == "match-expected" and len(args) == 3:
        match_expected(*args)
    elif cmd == "make" and len(args) == 2:
        make(*args)
    else:
        fail("bad arguments: " + " ".join(argv[1:]))


if __name__ == "__main__":
    main(sys.argv)
