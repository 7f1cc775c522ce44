#!/usr/bin/env bash
# export_equal.sh DT_CKPT DIR: the encrypted checkpoint DIR/enc/step-3.h5, exported with its key,
# holds the same tensors, byte for byte, as the plain DIR/plain/step-3.h5 of the same state. The
# export is plain: its metadata carries none of the encryption's attributes, and it is the user's
# only (mode 0600, whatever the umask), where the plain checkpoint's export follows the umask.
set -euo pipefail
tool=$1 dir=$2
"$tool" export "$dir/enc/step-3.h5" --output "$dir/enc.safetensors" --security.key_file "$dir/good.key"
"$tool" export "$dir/plain/step-3.h5" --output "$dir/plain.safetensors"
python3 - "$dir/enc.safetensors" "$dir/plain.safetensors" <<'PY'
import json, struct, sys
def tensors(path):
    b = open(path, 'rb').read()
    n = struct.unpack('<Q', b[:8])[0]
    h = json.loads(b[8:8 + n])
    body = b[8 + n:]
    return {k: (v['shape'], body[v['data_offsets'][0]:v['data_offsets'][1]])
            for k, v in h.items() if k != '__metadata__'}
a, p = tensors(sys.argv[1]), tensors(sys.argv[2])
b = open(sys.argv[1], 'rb').read()
meta = json.loads(b[8:8 + struct.unpack('<Q', b[:8])[0]])['__metadata__']
left = [k for k in ('encryption', 'key_salt', 'key_check', 'meta_tag', 'crypto_sha256') if k in meta]
assert not left, "the plain export carries %s" % left
assert a.keys() == p.keys() and a, (sorted(a), sorted(p))
for k in a:
    assert a[k] == p[k], k
print("export_equal: %d tensors identical" % len(a))
PY
mode=$(stat -c %a "$dir/enc.safetensors")
[ "$mode" = 600 ] || { echo "export_equal: the decrypted export has mode $mode, expected 600"; exit 1; }
[ "$(stat -c %a "$dir/plain.safetensors")" = "$(printf '%o' $((0666 & ~$(umask))))" ] ||
  { echo "export_equal: the plain export does not follow the umask"; exit 1; }
echo "export_equal: the decrypted export is mode 600 and carries no encryption attributes"
