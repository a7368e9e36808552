#!/usr/bin/env bash
# Tensor-parallel attention with head padding on NPROC GPUs of one host over NCCL
# (docs/distributed.md): tp = 1 vs tp = NPROC prefill time and logits equality; flash-shaped's
# 64 heads at tp = 8 leave 8 per rank, padded per call to HEAD_MULTIPLE (64 Hopper, 128
# Blackwell). Override any variable: NPROC=4 HEAD_MULTIPLE=128 bash bench/launch/tp_nccl.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-8} LENGTH=${LENGTH:-8192} HEAD_MULTIPLE=${HEAD_MULTIPLE:-64}
PRESET=${PRESET:-flash-shaped} DTYPE=${DTYPE:-float32} BACKEND=${BACKEND:-nccl}
OUT=${OUT:-bench/results/tp_prefill_${BACKEND}_tp${NPROC}.json}
exec torchrun --standalone --nproc-per-node "$NPROC" bench/cp_prefill.py --mode tp \
  --backend "$BACKEND" --preset "$PRESET" --length "$LENGTH" --head-multiple "$HEAD_MULTIPLE" \
  --dtype "$DTYPE" --json "$OUT"
