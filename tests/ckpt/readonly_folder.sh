#!/usr/bin/env bash
# ckpt.bad.readonly_folder: a checkpoint folder the user cannot write to is named as such
# ("Permission denied"), not as a missing lock file. Runs dt_train as an unprivileged user (root
# writes anywhere); skipped (exit 77) where that user cannot reach dt_train or this is not root.
#   readonly_folder.sh DT_TRAIN CONFIG TEXT
set -u
TRAIN=$1 CONFIG=$2 TEXT=$3
as_nobody() { setpriv --reuid=65534 --regid=65534 --clear-groups env HOME=/tmp "$@"; }
if [ "$(id -u)" != 0 ] || ! command -v setpriv >/dev/null || ! as_nobody test -x "$TRAIN" ||
   ! as_nobody test -r "$CONFIG"; then
  echo "SKIP ckpt.bad.readonly_folder: needs root, setpriv, and dt_train reachable by uid 65534"
  exit 77
fi
work=$(mktemp -d)
trap 'chmod -R u+w "$work"; rm -rf "$work"' EXIT
chmod 755 "$work" && mkdir "$work/ro" && chmod 555 "$work/ro"
out=$(as_nobody "$TRAIN" --config "$CONFIG" --data.path="$TEXT" --ckpt.dir="$work/ro" \
      --train.steps=1 2>&1)
rc=$?
echo "$out" | grep -E "error" || echo "$out" | tail -3
[ $rc -eq 2 ] || { echo "FAIL: exit code $rc, expected 2"; exit 1; }
echo "$out" | grep -qE "cannot open $work/ro/\.dt-lock to claim checkpoint folder .*: Permission denied" ||
  { echo "FAIL: the refusal does not say Permission denied"; exit 1; }
echo "readonly_folder.sh: PASS"
