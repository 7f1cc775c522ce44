#!/usr/bin/env bash
# Where a GPU step's time goes, for one run on a machine with an NVIDIA GPU: dt_train on gpt-small
# (bf16, batch 8 in micro-batches of 4, the head padded to 50304) with DT_CUDA_PROFILE=1 (the CUDA
# plugin's GPU time per entry, hal/README.md), eager and with engine.cuda_graphs, then PyTorch's
# eager step of the same model under bf16 autocast (perf/torch_gpt.py), with attention written out
# as dt runs it and with flash attention (F.scaled_dot_product_attention), where python3 has torch
# with CUDA.
#   DT_GPU_PAYLOAD=ARCHIVE perf/gpu_profile.sh [steps]    (perf/gpu_payload.sh makes ARCHIVE)
# Prints each run's last lines and the profiles; full logs go to $DT_GPU_LOGS when set.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
steps=${1:-20}
[ -f "${DT_GPU_PAYLOAD:-}" ] ||
  { echo "gpu_profile: DT_GPU_PAYLOAD='${DT_GPU_PAYLOAD:-}' is not a file (perf/gpu_payload.sh makes it)" >&2; exit 2; }
log=$(mktemp -d)
trap 'if [ -n "${DT_GPU_LOGS:-}" ]; then mkdir -p "$DT_GPU_LOGS"; cp "$log"/*.log "$DT_GPU_LOGS"/ 2>/dev/null || true; fi; rm -rf "$log"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tar -C "$log" -xJf "$DT_GPU_PAYLOAD"
P=$log/dt
limit=${DT_GPU_TIMEOUT:-300}
small=(--config "$root/configs/gpt-small.ini" --train.dtype=bf16 --model.vocab=50257
       --model.pad-vocab=64
       --data.val-fraction=0.1 --train.batch=8 --train.micro-batch=4 --train.steps="$steps"
       --train.eval-every=0 --runtime.device=cuda --runtime.plugin-path="$P/plugins"
       --data.path="$P/share/train.txt")
for graphs in false true; do
  echo "== dt_train gpt-small bf16, engine.cuda_graphs=$graphs"
  DT_CUDA_PROFILE=1 timeout "$limit" "$P/dtenv" "$P/bin/dt_train" "${small[@]}" \
    --engine.cuda_graphs=$graphs >"$log/profile-$graphs.log" 2>&1 || echo "exit $?"
  grep -E '^dt_train: done|^step .*/|^dt cuda profile|^[a-z_0-9]+ +[0-9]+ +[0-9.]+ |^entry |^matrix product|^[0-9]+ x [0-9]+ x [0-9]+ ' \
    "$log/profile-$graphs.log" || tail -20 "$log/profile-$graphs.log"
done
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  for att in plain sdpa; do
    echo "== PyTorch eager, bf16 autocast, attention $att"
    timeout "$limit" python3 "$root/perf/torch_gpt.py" --device cuda --dtype bf16 --layers 12 \
      --heads 12 --embd 768 --seq 1024 --vocab 50257 --batch 8 --micro 4 --steps "$steps" \
      --attention $att 2>&1 | tail -3 || echo "exit $?"
  done
else
  echo "gpu_profile: python3 has no torch with CUDA: the PyTorch reference was not run"
fi
