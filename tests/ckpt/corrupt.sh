#!/usr/bin/env bash
# ckpt.corrupt_byte / ckpt.truncated / ckpt.latest_deleted / ckpt.all_corrupt (MODE): auto-resume
# from a checkpoint directory holding step-3.h5 and step-6.h5 after damage:
#   corrupt_byte    one byte of /model/transformer.wte.weight's data in step-6.h5 flipped: step-6.h5
#                   is reported by name with "checksum mismatch" and the dataset; resumes at step 3,
#                   and its own step-6.h5 replaces the damaged one, which is set aside unchanged
#   truncated       step-6.h5 cut to half its size: reported by name; resumes at step 3
#   latest_deleted  DIR/latest removed: reported; resumes from the newest valid file (step 6)
#   latest_binary   DIR/latest overwritten with random bytes: described, not echoed; step 6 used
#   renamed         step-3.h5 copied to step-9.h5, which latest names: skipped, its step attribute
#                   named; resumes at step 6
#   all_corrupt     both files damaged: both reported; the run refuses to start (exit 2) and
#                   changes nothing; --ckpt.resume=none then starts from step 0 exactly like a
#                   fresh run (initial weights, empty optimiser state) and sets the damaged files
#                   aside (*.superseded) as it saves its own
#   lost_dataset    /model/transformer.ln_f.bias unlinked from step-6.h5 (DT_H5_EDIT, a test tool):
#                   step-6.h5 is reported as damaged ("a tensor was lost"), not as a checkpoint
#                   of another model; resumes at step 3
#   read_error_one_rank  the data reads of step-6.h5 fail on one rank only (a test seam): every
#                   rank refuses step-6.h5, naming the chunks that rank could not read and its
#                   error (not a checksum mismatch), and resumes at step 3
# A resumed run continues the original run's losses (within 1e-5 relative).
source "$(dirname "$0")/lib.sh"

W=/model/transformer.wte.weight
RUN=(--train.steps=6 --ckpt.every=3 --ckpt.dir=D)

train B 2 "${RUN[@]}" --train.log-file=B.jsonl
expect_rc B 0
expect_file D/step-3.h5
expect_file D/step-6.h5
expect_latest D step-6.h5

corrupt_wte() {  # corrupt_wte FILE: flips a byte 1000 bytes into the data of $W
  local addr
  # h5ls and h5dump: hdf5-tools, which scripts/bootstrap installs. The dataset is contiguous
  # and written in full, so it always has a data address.
  command -v h5ls >/dev/null && command -v h5dump >/dev/null ||
    { fail "h5ls or h5dump is missing (install hdf5-tools)"; finish; }
  addr=$(data_address "$1" "$W")
  if [ -z "$addr" ]; then
    fail "neither h5ls nor h5dump gives the data address of $W in $1"
    finish
  fi
  echo "$W in $1: raw data at offset $addr"
  flip_byte "$1" $((addr + 1000))
}

case "$MODE" in
  corrupt_byte)
    corrupt_wte D/step-6.h5
    sum6=$(sha256sum <D/step-6.h5)
    train R 2 "${RUN[@]}" --train.log-file=R.jsonl
    expect_rc R 0
    expect_report R "step-6\.h5" "checksum mismatch" "transformer.wte.weight"
    expect_line R "resumed from .*D/step-3\.h5 at step 3 "
    expect_line R "set aside .*D/step-6\.h5 -> .*D/step-6\.h5\.superseded"
    [ "$(sha256sum <D/step-6.h5.superseded)" = "$sum6" ] ||
      fail "the damaged step-6.h5 was not set aside unchanged"
    steplog steps R.jsonl 4 6
    steplog same B.jsonl R.jsonl 4 6 1e-5
    # The run wrote a good step-6.h5 over the damaged one.
    train V 2 --train.steps=6 --ckpt.dir=D --eval-only --eval.sequences=8
    expect_rc V 0
    expect_line V "resumed from .*D/step-6\.h5 at step 6 "
    expect_no_line V "skipping"
    ;;
  lost_dataset)
    "${DT_H5_EDIT:?the test tool h5_edit (DT_H5_EDIT)}" D/step-6.h5 unlink /model/transformer.ln_f.bias ||
      { fail "h5_edit could not unlink a dataset of D/step-6.h5"; finish; }
    train R 2 "${RUN[@]}" --train.log-file=R.jsonl
    expect_rc R 0
    expect_report R "step-6\.h5" "a tensor was lost, added or reshaped"
    expect_no_line R "does not match the model"
    expect_line R "resumed from .*D/step-3\.h5 at step 3 "
    steplog steps R.jsonl 4 6
    steplog same B.jsonl R.jsonl 4 6 1e-5
    ;;
  truncated)
    size=$(stat -c %s D/step-6.h5)
    truncate -s $((size / 2)) D/step-6.h5
    echo "truncated D/step-6.h5 from $size to $(stat -c %s D/step-6.h5) bytes"
    train R 2 "${RUN[@]}" --train.log-file=R.jsonl
    expect_rc R 0
    expect_line R "(skipping|ignoring|cannot|not a readable|truncated|corrupt).*D/step-6\.h5|D/step-6\.h5.*(skipping|ignoring|cannot|not a readable|truncated|corrupt)"
    expect_line R "resumed from .*D/step-3\.h5 at step 3 "
    steplog steps R.jsonl 4 6
    steplog same B.jsonl R.jsonl 4 6 1e-5
    ;;
  latest_deleted)
    rm D/latest
    train R 2 --train.steps=8 --ckpt.dir=D --train.log-file=R.jsonl
    expect_rc R 0
    expect_line R "latest is missing"
    expect_line R "resumed from .*D/step-6\.h5 at step 6 "
    expect_no_line R "skipping"
    steplog steps R.jsonl 7 8
    expect_latest D step-8.h5
    ;;
  latest_empty)
    : >D/latest
    train R 2 --train.steps=8 --ckpt.dir=D --train.log-file=R.jsonl
    expect_rc R 0
    expect_line R "latest names no checkpoint \(it is empty\)"
    expect_no_line R "latest is missing"
    expect_line R "resumed from .*D/step-6\.h5 at step 6 "
    ;;
  latest_binary)
    # latest overwritten with binary bytes: described by its size, never echoed; the newest
    # valid file is used.
    { printf '\001\376'; head -c 4094 /dev/urandom | tr -d '\n'; } >D/latest
    train R 2 --train.steps=8 --ckpt.dir=D --train.log-file=R.jsonl
    expect_rc R 0
    expect_line R "the pointer .*D/latest holds no file name: [0-9]+ bytes, which is not usable; using .*D/step-6\.h5"
    expect_line R "resumed from .*D/step-6\.h5 at step 6 "
    [ "$(wc -c <R.out)" -lt 20000 ] || fail "R.out holds $(wc -c <R.out) bytes: the pointer was echoed?"
    expect_latest D step-8.h5
    ;;
  latest_path)
    # latest edited to hold a path (to another folder's checkpoint): named as a path, not
    # followed; the newest valid file of this folder is used.
    echo "../elsewhere/step-3.h5" >D/latest
    train R 2 --train.steps=8 --ckpt.dir=D --train.log-file=R.jsonl
    expect_rc R 0
    expect_line R "the pointer .*D/latest holds the path \.\./elsewhere/step-3\.h5, not a file name of the folder, which is not usable; using .*D/step-6\.h5"
    expect_line R "resumed from .*D/step-6\.h5 at step 6 "
    ;;
  renamed)
    # A complete older file under a newer name, named by latest: its step attribute gives it away.
    cp D/step-3.h5 D/step-9.h5
    echo step-9.h5 >D/latest
    train R 2 --train.steps=8 --ckpt.dir=D --train.log-file=R.jsonl
    expect_rc R 0
    expect_line R "skipping .*D/step-9\.h5: .*its step attribute is 3, not the step its name says"
    expect_line R "resumed from .*D/step-6\.h5 at step 6 "
    steplog steps R.jsonl 7 8
    ;;
  all_corrupt)
    corrupt_wte D/step-3.h5
    corrupt_wte D/step-6.h5
    before=$(cd D && sha256sum step-3.h5 step-6.h5 latest)
    sum6=$(sha256sum <D/step-6.h5)
    train R 2 "${RUN[@]}" --train.log-file=R.jsonl
    expect_report R "step-6\.h5" "checksum mismatch" "transformer.wte.weight"
    expect_report R "step-3\.h5" "checksum mismatch" "transformer.wte.weight"
    # Checkpoints are there and none loads: the run refuses to start (a fresh start would go on
    # as if there had been none), names the way out, and changes nothing.
    expect_rc R 2
    expect_line R "none of the 2 checkpoints in .*D could be loaded"
    expect_line R "--ckpt.resume=none"
    expect_no_line R "starting from step 0|resumed from"
    [ "$(cd D && sha256sum step-3.h5 step-6.h5 latest)" = "$before" ] ||
      fail "the refused run changed the checkpoint folder: $(files_in D)"
    # Starting afresh on purpose: the initial state, the fresh run B step for step; the damaged
    # files are set aside as the new run saves its own steps 3 and 6, not deleted.
    train F 2 "${RUN[@]}" --ckpt.resume=none --train.log-file=F.jsonl
    expect_rc F 0
    steplog steps F.jsonl 1 6
    steplog same B.jsonl F.jsonl 1 6 1e-5
    expect_line F "set aside .*D/step-3\.h5 -> .*D/step-3\.h5\.superseded"
    expect_line F "set aside .*D/step-6\.h5 -> .*D/step-6\.h5\.superseded"
    [ "$(files_in D)" = "latest step-3.h5 step-3.h5.superseded step-6.h5 step-6.h5.superseded" ] ||
      fail "after the fresh run: $(files_in D)"
    [ "$(sha256sum <D/step-6.h5.superseded)" = "$sum6" ] ||
      fail "the set-aside step-6 is not the damaged file"
    expect_latest D step-6.h5
    ;;
  read_error_one_rank)
    # The data reads of step-6.h5 fail on rank 1 only (DT_TEST_CKPT_READ_FAIL, as an I/O error on
    # one node would), the file itself is sound: every rank refuses it and both resume at step 3,
    # none waits for the other.
    sum6=$(sha256sum <D/step-6.h5)
    saved=("${MPIEXEC[@]}")
    MPIEXEC=("${MPIEXEC[@]}" -x DT_TEST_CKPT_READ_FAIL=1:step-6.h5)
    train R 2 "${RUN[@]}" --train.log-file=R.jsonl
    MPIEXEC=("${saved[@]}")
    expect_rc R 0
    expect_report R "step-6\.h5" "transformer.wte.weight: chunk" "could not be read on rank 1:" \
      "H5Dread failed (DT_TEST_CKPT_READ_FAIL on rank 1"
    expect_line R "resumed from .*D/step-3\.h5 at step 3 "
    steplog steps R.jsonl 4 6
    steplog same B.jsonl R.jsonl 4 6 1e-5
    [ "$(sha256sum <D/step-6.h5.superseded)" = "$sum6" ] ||
      fail "step-6.h5 was not set aside unchanged"
    ;;
  *)
    echo "unknown mode '$MODE'"
    exit 2
    ;;
esac
finish
