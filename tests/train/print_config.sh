#!/usr/bin/env bash
# train.print_config_reads_back: dt_train ARGS --print-config prints its settings (the lines
# "key = value" before training's output); as a config file of their own they train the same
# run: the same loss lines, the same printed settings, every digit of a number kept.
#   print_config.sh WORKDIR DT_TRAIN ARGS...
set -u
WORK=$1 TRAIN=$2
shift 2
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
rm -rf "$WORK"
mkdir -p "$WORK"
cd "$WORK" || exit 1
"$TRAIN" "$@" --print-config >a.out 2>&1
rc=$?
[ $rc -eq 0 ] || { cat a.out; fail "the first run exited $rc"; }
grep -E '^[a-z0-9_.-]+ = ' a.out | grep -v '^print-config = ' >printed.ini
[ -s printed.ini ] || fail "no settings printed"
grep -q '^optim.lr = 0.0012345678$' printed.ini || fail "optim.lr printed as '$(grep '^optim.lr' printed.ini)'"
"$TRAIN" --config printed.ini --print-config >b.out 2>&1
rc=$?
[ $rc -eq 0 ] || { cat b.out; fail "the printed config exited $rc"; }
grep -E '^[a-z0-9_.-]+ = ' b.out | grep -v '^print-config = ' >again.ini
diff printed.ini again.ini || fail "the settings read back differ (above)"
diff <(grep -oE '^step .*\| norm [0-9.]+' a.out) <(grep -oE '^step .*\| norm [0-9.]+' b.out) || fail "the runs' steps differ (above)"
grep -qE '^step ' b.out || fail "no step lines"
[ $FAILED -eq 0 ] && { echo "print_config.sh: PASS"; exit 0; }
echo "print_config.sh: FAIL"
exit 1
