#!/usr/bin/env bash
# same_params.sh OUTDIR VARIANT... -- CMD...
# Runs CMD once per VARIANT (a string of extra options), each saving its final checkpoint under
# OUTDIR/<n>, and requires every run to end with the same parameters and optimiser moments bit
# for bit (compared through the SHA-256 digests dt stores for every dataset). A control run of
# the first variant with another seed must differ, so the comparison is known to see a change.
set -u
out=$1
shift
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
shift
rm -rf "$out"
mkdir -p "$out"
digests() { h5dump -g /checksums "$1" | grep -v '^HDF5 ' | md5sum | cut -d' ' -f1; }
run() {  # run DIR OPTIONS...
  local dir=$1
  shift
  if ! "$CMD_0" "${CMD_REST[@]}" --ckpt.dir="$dir" "$@" >"$dir.log" 2>&1; then
    cat "$dir.log"
    echo "same_params.sh: FAIL: run with '$*' failed"
    exit 1
  fi
  local f
  f=$(ls "$dir"/step-*.h5 2>/dev/null | head -1)
  [ -n "$f" ] || { cat "$dir.log"; echo "same_params.sh: FAIL: no checkpoint in $dir"; exit 1; }
  digests "$f"
}
CMD_0=$1
shift
CMD_REST=("$@")
ref=""
i=0
for v in "${variants[@]}"; do
  # shellcheck disable=SC2086
  d=$(run "$out/$i" $v) || { echo "$d"; exit 1; }
  echo "variant $i ($v): $d"
  if [ -z "$ref" ]; then
    ref=$d
  elif [ "$d" != "$ref" ]; then
    echo "same_params.sh: FAIL: variant '$v' ends with different parameters than '${variants[0]}'"
    exit 1
  fi
  i=$((i + 1))
done
# shellcheck disable=SC2086
c=$(run "$out/control" ${variants[0]} --train.seed=7) || { echo "$c"; exit 1; }
echo "control (seed 7): $c"
[ "$c" != "$ref" ] || { echo "same_params.sh: FAIL: control run did not differ"; exit 1; }
echo "same_params.sh: PASS: ${#variants[@]} variants with identical parameters"
