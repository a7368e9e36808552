#!/usr/bin/env bash
# Context-parallel prefill on NPROC GPUs of one host over NCCL (docs/distributed.md):
# cp = 1 vs cp = NPROC prefill time and final-token logits equality. Override any variable:
#   NPROC=8 LENGTH=32768 CHUNK=2048 DTYPE=float32 bash bench/launch/cp_nccl.sh
# Across hosts: replace --standalone by --nnodes/--node-rank/--rdzv-endpoint (torchrun docs).
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-8} LENGTH=${LENGTH:-16384} CHUNK=${CHUNK:-1024}
PRESET=${PRESET:-flash-shaped} DTYPE=${DTYPE:-float32} BACKEND=${BACKEND:-nccl}
OUT=${OUT:-bench/results/cp_prefill_${BACKEND}_cp${NPROC}.json}
exec torchrun --standalone --nproc-per-node "$NPROC" bench/cp_prefill.py --mode cp \
  --backend "$BACKEND" --preset "$PRESET" --length "$LENGTH" --chunk-len "$CHUNK" \
  --dtype "$DTYPE" --json "$OUT"
