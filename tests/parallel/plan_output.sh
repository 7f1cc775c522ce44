#!/usr/bin/env bash
# plan_output.sh DOT_FILE "REGEX;REGEX..." FORBIDDEN_REGEX -- CMD...
# Runs CMD (a dt_train --print-plan job); passes when it exits 0, prints a line matching each
# REGEX, no line matching FORBIDDEN_REGEX ("" for none), and DOT_FILE holds a Graphviz digraph
# with one cluster per pipeline stage and the pipeline edges, and node labels on two lines.
set -u
dot=$1
IFS=';' read -r -a want <<<"$2"
forbidden=$3
shift 3
[ "${1:-}" = "--" ] && shift
rm -f "$dot"
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
fail=0
[ "$rc" -eq 0 ] || { echo "FAIL: exit code $rc"; fail=1; }
for re in "${want[@]}"; do
  printf '%s\n' "$out" | grep -Eq -- "$re" || { echo "FAIL: no line matches /$re/"; fail=1; }
done
if [ -n "$forbidden" ] && printf '%s\n' "$out" | grep -Eq -- "$forbidden"; then
  echo "FAIL: a line matches /$forbidden/"
  fail=1
fi
if [ ! -s "$dot" ]; then
  echo "FAIL: $dot was not written"
  fail=1
else
  stages=$(printf '%s\n' "$out" | sed -n 's/.*plan: dp=[0-9]* tp=[0-9]* pp=\([0-9]*\).*/\1/p')
  head -1 "$dot" | grep -q '^digraph ' || { echo "FAIL: $dot is not a digraph"; fail=1; }
  n=$(grep -c 'subgraph cluster_stage' "$dot")
  [ "$n" = "$stages" ] || { echo "FAIL: $dot has $n stage clusters, the plan $stages"; fail=1; }
  # A node's label is its op and its name on two lines: DOT's \n, not an escaped backslash.
  grep -q 'label="embedding\\ntransformer\.wte+wpe"' "$dot" ||
    { echo "FAIL: $dot has no label \"embedding\\ntransformer.wte+wpe\""; fail=1; }
  grep -q '\\\\n' "$dot" && { echo "FAIL: $dot holds an escaped backslash before n"; fail=1; }
  if [ "${stages:-1}" -gt 1 ]; then
    grep -q 'style=dashed' "$dot" || { echo "FAIL: $dot has no pipeline edge"; fail=1; }
  fi
fi
[ $fail -eq 0 ] && echo "PASS" || echo "FAILED"
exit $fail
