#!/usr/bin/env bash
# bad_input.sh ... -- KIND: makes the input of case KIND in WORK and runs dt_ckpt on it; its
# output and exit code are the script's (expect.sh checks them).
. "$(dirname "$0")/common.sh"
kind=$1
case $kind in
  not_dt_hdf5)  # a real HDF5 file without the checkpoint attributes
    h5copy -p -i "$CKPT" -o "$WORK/plain.h5" -s /model -d /model || fail h5copy
    exec "$DT_CKPT" verify "$WORK/plain.h5" ;;
  no_heads)
    "$PY" "$TOOLS/st_tool.py" make valid "$WORK/$kind.safetensors" || fail "st_tool.py"
    exec "$DT_CKPT" import "$WORK/$kind.safetensors" --output "$WORK/out" ;;
  *)
    "$PY" "$TOOLS/st_tool.py" make "$kind" "$WORK/$kind.safetensors" || fail "st_tool.py"
    exec "$DT_CKPT" import "$WORK/$kind.safetensors" --output "$WORK/out" --heads 2 ;;
esac
