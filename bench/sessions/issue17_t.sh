#!/usr/bin/env bash
# Device session, 2026-12-04 (13): the 200K x 8 runs again after the bench fix of this commit
# (requests generate enough tokens that none finishes before the timed steps end: before it,
# the first requests decoded through the other prefills and finished, so the "x 8" runs at 200K
# timed about 2-4 requests a step). Two calls on one warm machine: `a` trains flash-shaped
# for 2.5 minutes and re-runs tiny-trained at 200K x 8 (plain graph decode and graph verify);
# `b` runs the trained flash-shaped file at 200K x 8.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
W=train_out/flash-shaped.safetensors
case "${1:-}" in
a)
  step train_flash 300 python -m adapters.train --device cuda --preset flash-shaped --batch 4 \
    --seq-len 2048 --lr 6e-4 --warmup 30 --log-every 25 --budget-minutes 2.5 --max-minutes 3.5 \
    --eval-bytes 65536 --out "$W" --log "$OUT/train_flash_short_h200.json"
  step tiny200k 150 taskset -c 2-5 python bench/hisparse_graph_trained.py --device cuda \
    --split train --context 200000 --batch 8 --steps 96 --chunk 8192 --commit-every 8 \
    --repeat 2 --json "$OUT/hisparse_graph_trained_200k_b8_h200.json"
  step spec200k 150 taskset -c 2-5 python bench/hisparse_graph_trained.py --device cuda \
    --split train --context 200000 --batch 8 --steps 48 --chunk 8192 --commit-every 8 \
    --repeat 1 --speculative 2 --json "$OUT/hisparse_graph_spec_200k_b8_h200.json" ;;
b)
  step flash200k 560 taskset -c 2-5 python bench/hisparse_graph_trained.py --device cuda \
    --weights "$W" --split train --context 200000 --batch 8 --steps 48 --chunk 8192 \
    --commit-every 8 --repeat 2 --json "$OUT/hisparse_graph_flash_trained_200k_b8_h200.json" ;;
*) echo "usage: $0 a|b" >&2; exit 2 ;;
esac
