#!/usr/bin/env bash
# Context-parallel prefill on NPROC GPUs of one host over NCCL, handed to rank 0's decode
# engine (docs/distributed.md, "From a CP prefill to decode"): time to first token against one
# engine prefilling the prompt itself, and equal greedy tokens. Override any variable:
#   NPROC=8 LENGTH=32768 CHUNK=2048 DTYPE=float32 bash bench/launch/cp_decode_nccl.sh
# BACKEND=gloo NPROC=2 PRESET=tiny DTYPE=float64 runs the same path on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-8} LENGTH=${LENGTH:-16384} CHUNK=${CHUNK:-1024} NEW=${NEW:-16}
PRESET=${PRESET:-flash-shaped} DTYPE=${DTYPE:-float32} BACKEND=${BACKEND:-nccl}
OUT=${OUT:-bench/results/cp_decode_${BACKEND}_cp${NPROC}.json}
exec torchrun --standalone --nproc-per-node "$NPROC" bench/cp_decode.py --backend "$BACKEND" \
  --preset "$PRESET" --length "$LENGTH" --cp-chunk "$CHUNK" --new-tokens "$NEW" \
  --dtype "$DTYPE" --json "$OUT"
