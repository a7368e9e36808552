#!/usr/bin/env bash
# Device session, 2026-12-04 (11): flash-shaped with weights that learned something, for the
# 200K x 8 HiSparse graph target (the random-weight runs are bus-bound: 78 % of the entries
# miss a 20 % buffer). Two calls on one warm machine: `train` (about 5 minutes of
# python -m adapters.train on KJV; batch 2 if batch 4 does not fit), then `bench` (the trained
# file through bench/hisparse_graph_trained.py, interleaved repetitions, pinned to four cores).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
W=train_out/flash-shaped.safetensors
case "${1:-}" in
train)
  step train_flash 450 python -m adapters.train --device cuda --preset flash-shaped --batch 4 \
    --seq-len 2048 --lr 6e-4 --warmup 30 --log-every 25 --budget-minutes 5 --max-minutes 6.5 \
    --out "$W" --log "$OUT/train_flash_h200.json" \
    || step train_flash_b2 400 python -m adapters.train --device cuda --preset flash-shaped \
    --batch 2 --seq-len 2048 --lr 6e-4 --warmup 30 --log-every 25 --budget-minutes 4 \
    --max-minutes 5.5 --out "$W" --log "$OUT/train_flash_h200.json"
  ls -l "$W" >> "$OUT/session.log" 2>&1 ;;
bench)
  step flash_trained200k 560 taskset -c 2-5 python bench/hisparse_graph_trained.py --device cuda \
    --weights "$W" --split train --context 200000 --batch 8 --steps 64 --chunk 8192 \
    --commit-every 8 --repeat 2 --json "$OUT/hisparse_graph_flash_trained_200k_h200.json" ;;
*) echo "usage: $0 train|bench" >&2; exit 2 ;;
esac
