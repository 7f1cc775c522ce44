#!/usr/bin/env bash
# ckpt.bad.readonly_folder: a checkpoint folder the user cannot write to is named as such
# ("Permission denied"), not as a missing lock file; one that holds another user's lock file
# (a folder used before) is refused as not writable before training, not at the first save;
# a folder the user can write whose lock file is another user's and read-only (a group's
# folder) is used; a checkpoint the user may not read is named so. Runs dt_train as an
# unprivileged user (root writes anywhere); skipped (exit 77) where that user cannot reach
# dt_train or this is not root.
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
# refused WHAT WANT_REGEX ARGS...: dt_train ARGS as the unprivileged user exits 2 with a line
# matching WANT_REGEX; OUT holds what it printed.
refused() {
  local what=$1 want=$2 rc
  shift 2
  OUT=$(as_nobody "$TRAIN" --config "$CONFIG" --data.path="$TEXT" "$@" 2>&1)
  rc=$?
  echo "$OUT" | grep -E "error" || echo "$OUT" | tail -3
  [ $rc -eq 2 ] || { echo "FAIL: $what: exit code $rc, expected 2"; exit 1; }
  echo "$OUT" | grep -qE "$want" || { echo "FAIL: $what: no line matches /$want/"; exit 1; }
}
chmod 755 "$work" && mkdir "$work/ro" && chmod 555 "$work/ro"
refused "read-only folder" \
  "cannot open $work/ro/\.dt-lock to claim checkpoint folder .*: Permission denied" \
  --ckpt.dir="$work/ro" --train.steps=1

# A folder used before (root's lock file in it), read-only to this user.
mkdir "$work/used" && touch "$work/used/.dt-lock" && chmod 644 "$work/used/.dt-lock" &&
  chmod 555 "$work/used"
refused "used read-only folder" \
  "checkpoint folder $work/used is not writable by this run \(making a file there: Permission denied\)" \
  --ckpt.dir="$work/used" --train.steps=2 --train.log-every=1
! echo "$OUT" | grep -q "step 1" || { echo "FAIL: it trained before refusing"; exit 1; }
[ "$(ls -A "$work/used")" = .dt-lock ] || { echo "FAIL: files left: $(ls -A "$work/used")"; exit 1; }

# A group's folder: writable by all, the lock file another user's and read-only: used.
mkdir "$work/group" && touch "$work/group/.dt-lock" && chmod 644 "$work/group/.dt-lock" &&
  chmod 1777 "$work/group"
out=$(as_nobody "$TRAIN" --config "$CONFIG" --data.path="$TEXT" --ckpt.dir="$work/group" \
      --train.steps=2 2>&1)
rc=$?
[ $rc -eq 0 ] || { echo "$out" | tail -5; echo "FAIL: group folder: exit code $rc, expected 0"; exit 1; }
[ -f "$work/group/step-2.h5" ] ||
  { echo "FAIL: no checkpoint in the group folder: $(ls -A "$work/group")"; exit 1; }

# A checkpoint this user may not read is named as such, not as "no HDF5 signature".
cp "$work/group/step-2.h5" "$work/secret.h5" && chmod 600 "$work/secret.h5"
refused "unreadable checkpoint" "secret.h5: cannot be read \(Permission denied\)" \
  --ckpt.resume="$work/secret.h5" --train.steps=3
echo "readonly_folder.sh: PASS"
