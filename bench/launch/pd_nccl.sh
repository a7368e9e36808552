#!/usr/bin/env bash
# PD disaggregation on two GPUs of one host over NCCL (#16 item 1; for the multi-GPU issue):
# rank 0 (GPU 0) prefills, rank 1 (GPU 1) imports the prefix by page index and decodes.
# Page bytes go device to device (NCCL send/recv); the layout and the answers are pickled
# objects (send_object_list). Written, not yet run on GPUs (its torchrun path ran on CPU with
# --device cpu --backend gloo). Across hosts: replace --standalone by --nnodes/--rdzv-endpoint.
#
#   bench/launch/pd_nccl.sh                         # defaults below
#   PROMPT_LEN=131072 REPS=5 bench/launch/pd_nccl.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PROMPT_LEN=${PROMPT_LEN:-32768}
REPS=${REPS:-5}
MODEL=${MODEL:-flash-shaped}
OUT=${OUT:-bench/results/pd_nccl_2gpu.json}
ROWS=$(mktemp -d)
export NCCL_NVLS_ENABLE=0  # no NVLink multicast (the lent machines' rule)
"${TORCHRUN:-torchrun}" --standalone --nproc_per_node 2 bench/pd_transfer.py \
    --device cuda --backend nccl --model "$MODEL" --prompt-len "$PROMPT_LEN" --reps "$REPS" \
    --rows-dir "$ROWS" --json "$OUT"
rm -rf "$ROWS"
