#!/usr/bin/env bash
# ckpt.unlistable: a checkpoint folder its run can write in but not list (mode 0333, owned by the
# user that runs dt_train: nobody, through setpriv; root only, else SKIP). Taken for empty, it
# would make a resume start afresh and its first save set aside every checkpoint there. Instead
# the run is refused before it trains (exit 2), naming the folder and the error, and the
# checkpoints are left byte for byte; so is a run whose `latest` is gone too (the check of the
# checkpoint's model, before the model exists, lists the folder then); `dt_ckpt list` refuses it
# too (exit 2), where it said "0 checkpoints".
source "$(dirname "$0")/lib.sh"
CKPT_TOOL=$(dirname "$BIN")/dt_ckpt

train P 2 --train.steps=2 --ckpt.every=1 --ckpt.dir=D
expect_rc P 0
expect_latest D step-2.h5
as_nobody=(setpriv --reuid=65534 --regid=65534 --clear-groups env HOME=/tmp TMPDIR=/tmp)
if [ "$(id -u)" != 0 ] || ! command -v setpriv >/dev/null ||
  ! "${as_nobody[@]}" test -x "$BIN" -a -r "$CONFIG" -a -r "$TEXT" -a -x "$WORK"; then
  echo "SKIP: needs root, setpriv, and dt_train, its config and text open to the user nobody"
  exit 77
fi
# train_nobody NAME ARGS...: dt_train as nobody on one rank; output in NAME.out, exit code in $RC.
train_nobody() {
  local name=$1
  shift
  echo "=== $name: dt_train as nobody, one rank: $*"
  timeout -k 10 "$RUN_LIMIT" "${as_nobody[@]}" "$BIN" --config "$CONFIG" --data.path="$TEXT" "$@" \
    >"$name.out" 2>&1
  RC=$?
  sed 's/^/    /' "$name.out"
}
chown -R 65534:65534 D
chmod 0333 D
before=$(cd D && sha256sum latest step-1.h5 step-2.h5)

train_nobody N --train.steps=4 --ckpt.every=1 --ckpt.dir=D
expect_rc N 2
expect_line N "^dt_train: error: --ckpt.resume=auto: cannot list the checkpoint folder D: Permission denied; nothing was changed$"
expect_no_line N "starting from step 0|dt_train: [0-9]+ parameters"

echo "=== dt_ckpt list D, as nobody"
"${as_nobody[@]}" "$CKPT_TOOL" list D >L.out 2>&1
RC=$?
sed 's/^/    /' L.out
expect_rc L 2
expect_line L "^dt_ckpt list: error: cannot list the checkpoint folder D: Permission denied$"

chmod 0755 D
[ "$(cd D && sha256sum latest step-1.h5 step-2.h5)" = "$before" ] || fail "D's checkpoints changed"
[ "$(files_in D)" = "latest step-1.h5 step-2.h5" ] || fail "files in D: $(files_in D)"

rm D/latest
chmod 0333 D
train_nobody O --train.steps=4 --ckpt.every=1 --ckpt.dir=D  # (D/latest gone)
expect_rc O 2
expect_line O "^dt_train: error: cannot list the checkpoint folder D: Permission denied"
expect_no_line O "starting from step 0|dt_train: [0-9]+ parameters"
chmod 0755 D
[ "$(files_in D)" = "step-1.h5 step-2.h5" ] || fail "files in D after O: $(files_in D)"
finish
