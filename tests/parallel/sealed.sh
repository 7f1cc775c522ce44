#!/usr/bin/env bash
# sealed.sh WORKDIR DT_TRAIN CONFIG TEXT MODE MPIEXEC...
# Sealed tensor traffic through dt_train (security.seal, security.key_file, ckpt.encrypt):
#   same      seal=p2p and seal=all on dp=2 pp=2 give exactly the losses of the unsealed run
#             (seal=all also with security.shm=false: through the transport, not the mailboxes;
#             and with security.exempt-node-local: this node's ranks unsealed; and with
#             security.aes=openssl on every rank, or on ranks 0 and 1 only while 2 and 3 take
#             auto (ipsec-mb where dt has it): the same bytes from either AES-GCM code)
#   flip|replay|reorder  one rank's sealed pipeline (or, with pp=1, gradient) messages are
#             tampered with: the receiver names the peer and sequence number, the job aborts
#             (exit 5) and no rank hangs (bounded time)
#   device    seal=all on test-plugins/libdt_hal_devmem.so (device memory) equals the CPU run,
#             and a flipped bit still aborts the job
#   keys      a key file readable by others is refused (naming the file and 0644); an encrypted
#             checkpoint does not load with another key, and the run does not start afresh; a
#             rank whose key file holds another key than rank 0's is refused on start (exit 2,
#             naming its file), for encrypted checkpoints and for sealed traffic
#   tampered  the newest encrypted checkpoint, rewritten without the key so that every digest
#             still matches (two tensors swapped with their digests, nonces and tags; the tool in
#             $CKPT_TAMPER), stops resume=auto: exit 2 naming the file as tampered, no training,
#             the folder untouched; the same file with only damage (the tag digests left behind)
#             is skipped and the run resumes from the older checkpoint
set -u
WORK=$1 BIN=$2 CONFIG=$3 TEXT=$4 MODE=$5
shift 5
MPIEXEC=("$@")
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
trap 'cd /; rm -rf "$WORK"' EXIT
fail=0
FAIL() { echo "FAIL: $*"; fail=1; }
umask 077
head -c 32 /dev/urandom >key.bin
head -c 32 /dev/urandom >other.bin
COMMON=(--config "$CONFIG" --data.path="$TEXT" --train.log-every=1 --train.eval-every=0)
launched() {  # launched NAME: after a launch into NAME.out, shows it and its exit code (in RC)
  RC=$?
  sed 's/^/    /' "$1.out"
  echo "=== $1: exit code $RC"
  [ "$RC" -ne 124 ] && [ "$RC" -ne 137 ] || FAIL "$1: timed out (hang)"
}
run() {  # run NAME RANKS ARGS...: output in NAME.out, exit code in RC
  local name=$1 n=$2
  shift 2
  timeout -k 5 120 "${MPIEXEC[@]}" -n "$n" "$BIN" "${COMMON[@]}" --train.steps="${STEPS:-4}" "$@" \
    >"$name.out" 2>&1
  launched "$name"
}
case "$MODE" in
  same)
    run plain 4 --parallel.pp=2 --train.log-file=plain.jsonl
    [ "$RC" -eq 0 ] || FAIL "plain run failed"
    # Between the ranks of this node sealed messages go through the shared-memory mailboxes;
    # all-transport (security.shm=false) sends them through MPI; all-exempt leaves the ranks of
    # this node (here: all) unsealed, as MPI knows them (security.exempt-node-local).
    for seal in p2p all all-transport all-exempt all-openssl all-mixed; do
      opts=(--security.seal="${seal%%-*}")
      [ "$seal" = all-transport ] && opts+=(--security.shm=false)
      [ "$seal" = all-exempt ] && opts+=(--security.exempt-node-local=true)
      [ "$seal" = all-openssl ] && opts+=(--security.aes=openssl)
      if [ "$seal" = all-mixed ]; then
        # Two programs of one job (MPMD): ranks 0 and 1 through OpenSSL, 2 and 3 through
        # ipsec-mb where this dt has it (the `all` run, on auto, said so), else OpenSSL too.
        other=(--security.aes=ipsec-mb)
        if ! grep -q "AES-256-GCM by ipsec-mb" all.out; then
          echo "SKIP (part): no ipsec-mb on this machine; all-mixed runs OpenSSL on every rank"
          other=(--security.aes=openssl)
        fi
        args=("${COMMON[@]}" --train.steps="${STEPS:-4}" --parallel.pp=2 "${opts[@]}"
          --security.key_file=key.bin --train.log-file=$seal.jsonl)
        timeout -k 5 120 "${MPIEXEC[@]}" -n 2 "$BIN" "${args[@]}" --security.aes=openssl : \
          -n 2 "$BIN" "${args[@]}" "${other[@]}" >"$seal.out" 2>&1
        launched "$seal"
      else
        run "$seal" 4 --parallel.pp=2 "${opts[@]}" \
          --security.key_file=key.bin --train.log-file=$seal.jsonl
      fi
      [ "$RC" -eq 0 ] || FAIL "seal=$seal run failed"
      if [ "$seal" = all-openssl ] || [ "$seal" = all-mixed ]; then
        grep -q "AES-256-GCM by OpenSSL's EVP" "$seal.out" ||
          FAIL "seal=$seal: rank 0 does not say it seals through OpenSSL"
      fi
      # Loss, lr, norm of every step, bit for bit (the seconds differ).
      a=$(sed -E 's/"seconds": [0-9.e+-]+//' plain.jsonl)
      b=$(sed -E 's/"seconds": [0-9.e+-]+//' $seal.jsonl)
      [ -n "$a" ] && [ "$a" = "$b" ] || FAIL "seal=$seal: the step log differs from the unsealed run"
    done
    ;;
  device)
    # Sealed gradients of a device whose memory the host cannot touch: staged through host copies
    # into the sealed communicator, the same bits as the CPU device unsealed; tampering is still
    # caught.
    dev=(--runtime.device=devmem --runtime.plugin-path="$(dirname "$BIN")/../test-plugins")
    run plain 2 --train.micro-batch=2 --train.log-file=plain.jsonl
    run sealed 2 --train.micro-batch=2 --security.seal=all --security.key_file=key.bin \
      --train.log-file=sealed.jsonl "${dev[@]}"
    [ "$RC" -eq 0 ] || FAIL "sealed run on devmem failed"
    a=$(sed -E 's/"seconds": [0-9.e+-]+//' plain.jsonl)
    b=$(sed -E 's/"seconds": [0-9.e+-]+//' sealed.jsonl)
    [ -n "$a" ] && [ "$a" = "$b" ] || FAIL "devmem, seal=all: the step log differs from the CPU run"
    run flip 2 --security.seal=all --security.key_file=key.bin --test.tamper=flip:2 \
      --test.tamper-rank=0 "${dev[@]}"
    [ "$RC" -eq 5 ] || FAIL "devmem flip: exit code $RC, not 5"
    grep -q "aborting the job" flip.out || FAIL "devmem flip: the job was not aborted"
    ;;
  flip | replay | reorder)
    args=(--security.seal=all --security.key_file=key.bin --test.tamper=$MODE:2 --test.tamper-rank=0)
    run pipe 2 --parallel.pp=2 "${args[@]}"
    run grads 2 "${args[@]}"
    for r in pipe grads; do
      grep -Eq "rank [0-9]+: security: rejected message [0-9]+ from rank 0 to rank 1 .*sequence number [0-9]+" $r.out ||
        FAIL "$r: no line names the rejected message, its peer and sequence number"
      grep -q "aborting the job" $r.out || FAIL "$r: the job was not aborted"
    done
    # On a communicator split from the world (the data-parallel group of tp=2), the sender's rank
    # there is named with its world rank, which says which node to look at.
    run split 4 --parallel.tp=2 --security.seal=all --security.key_file=key.bin \
      --test.tamper=$MODE:2 --test.tamper-rank=2
    grep -Eq "security: rejected message [0-9]+ from rank [0-9]+ \(world rank 2\) to rank [0-9]+ .*on world/split" split.out ||
      FAIL "split: the rejection does not name the sender's world rank"
    ;;
  keys)
    cp key.bin open.bin && chmod 0644 open.bin
    run open 1 --security.seal=p2p --security.key_file=open.bin
    [ "$RC" -eq 2 ] || FAIL "a 0644 key file: exit code $RC, expected 2"
    grep -q "open.bin.*0644" open.out || FAIL "the refusal does not name the file and its mode"
    run enc 2 --parallel.pp=2 --ckpt.dir=D --ckpt.encrypt=true --security.key_file=key.bin
    [ "$RC" -eq 0 ] || FAIL "encrypted checkpoint run failed"
    [ -f D/step-4.h5 ] || FAIL "D/step-4.h5 is missing"
    STEPS=6 run wrong 2 --parallel.pp=2 --ckpt.dir=D --ckpt.encrypt=true \
      --security.key_file=other.bin
    [ "$RC" -eq 2 ] || FAIL "another key: exit code $RC, expected 2"
    grep -q "checkpoint key:" wrong.out || FAIL "another key: no 'checkpoint key:' message"
    grep -q "^step " wrong.out && FAIL "another key: training started"
    STEPS=6 run right 1 --ckpt.dir=D --ckpt.encrypt=true --security.key_file=key.bin
    [ "$RC" -eq 0 ] || FAIL "the right key: exit code $RC"
    grep -q "resumed from .*step-4.h5 at step 4" right.out || FAIL "the right key did not resume"
    # One rank (one node, in a real job) with another key file: refused on start, before a
    # checkpoint is read or written, naming that rank's file; the folder is untouched. Both
    # for encrypted checkpoints (resuming D) and for sealed traffic alone.
    before=$(cd D && find . -type f ! -name .dt-lock -exec sha256sum {} + | sort)
    for what in ckpt seal; do
      if [ "$what" = ckpt ]; then opts=(--ckpt.dir=D --ckpt.encrypt=true); else opts=(--security.seal=all); fi
      args=("${COMMON[@]}" --train.steps=8 "${opts[@]}")
      timeout -k 5 120 "${MPIEXEC[@]}" -n 1 "$BIN" "${args[@]}" --security.key_file=key.bin : \
        -n 1 "$BIN" "${args[@]}" --security.key_file=other.bin >mixed-$what.out 2>&1
      launched mixed-$what
      [ "$RC" -eq 2 ] || FAIL "mixed keys ($what): exit code $RC, expected 2"
      grep -q "rank 1: option --security.key_file: other.bin on this rank's node .* holds another key than rank 0's" \
        mixed-$what.out || FAIL "mixed keys ($what): the refusal does not name rank 1's key file"
      grep -qE "^step |resumed from|saved " mixed-$what.out && FAIL "mixed keys ($what): the run went on"
    done
    after=$(cd D && find . -type f ! -name .dt-lock -exec sha256sum {} + | sort)
    [ "$before" = "$after" ] || FAIL "the refused runs changed the checkpoint folder"
    ;;
  tampered)
    [ -x "${CKPT_TAMPER:-}" ] || { echo "CKPT_TAMPER (the ckpt_tamper tool) is not set"; exit 2; }
    enc=(--ckpt.encrypt=true --security.key_file=key.bin)
    run enc 2 --ckpt.dir=T --ckpt.every=2 "${enc[@]}"
    [ "$RC" -eq 0 ] || FAIL "encrypted checkpoint run failed"
    [ -f T/step-2.h5 ] && [ -f T/step-4.h5 ] || FAIL "T/step-2.h5 or T/step-4.h5 is missing"
    cp -a T D
    "$CKPT_TAMPER" T/step-4.h5 || FAIL "ckpt_tamper T/step-4.h5 failed"
    "$CKPT_TAMPER" D/step-4.h5 --keep-tag-digests || FAIL "ckpt_tamper D/step-4.h5 failed"
    # Everything but the folder lock (it names its last holder).
    before=$(cd T && find . -type f ! -name .dt-lock -exec sha256sum {} + | sort)
    STEPS=6 run tampered 2 --ckpt.dir=T --ckpt.every=2 "${enc[@]}"
    [ "$RC" -eq 2 ] || FAIL "a tampered newest checkpoint: exit code $RC, expected 2"
    grep -q "T/step-4.h5: tampered:" tampered.out && grep -q "(tampering)" tampered.out ||
      FAIL "the refusal does not name step-4.h5 as tampered"
    grep -q "^step " tampered.out && FAIL "a tampered newest checkpoint: training started"
    grep -q "resumed from" tampered.out && FAIL "a tampered newest checkpoint: an older one was loaded"
    after=$(cd T && find . -type f ! -name .dt-lock -exec sha256sum {} + | sort)
    [ "$before" = "$after" ] || { diff <(echo "$before") <(echo "$after"); FAIL "the refused run changed the checkpoint folder"; }
    "$(dirname "$BIN")/dt_ckpt" verify T/step-4.h5 --security.key_file=key.bin >verify.out 2>&1
    RC=$?
    sed 's/^/    /' verify.out
    [ "$RC" -eq 1 ] && grep -q "(tampering)" verify.out ||
      FAIL "dt_ckpt verify of the tampered file: exit code $RC, or no '(tampering)'"
    STEPS=6 run damaged 2 --ckpt.dir=D --ckpt.every=2 "${enc[@]}"
    [ "$RC" -eq 0 ] || FAIL "a damaged newest checkpoint: exit code $RC, expected 0"
    grep -q "skipping .*D/step-4.h5" damaged.out || FAIL "the damaged step-4.h5 is not named"
    grep -q "resumed from .*step-2.h5 at step 2" damaged.out ||
      FAIL "past a damaged newest checkpoint the run did not resume from step-2.h5"
    [ -f D/step-6.h5 ] || FAIL "the resumed run did not save D/step-6.h5"
    ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac
[ $fail -eq 0 ] && echo "sealed.sh $MODE: PASS" || echo "sealed.sh $MODE: FAIL"
exit $fail
