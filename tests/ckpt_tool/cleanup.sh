#!/usr/bin/env bash
# Fixture end: removes the checkpoints and every test's scratch folder.
. "$(dirname "$0")/common.sh"
rm -rf "$CKPTS" "$(dirname "$WORK")" || fail "cannot remove $CKPTS"
[ ! -e "$CKPTS" ] || fail "$CKPTS still exists"
pass "removed $CKPTS and $(dirname "$WORK")"
