#!/usr/bin/env bash
# Device session, 2026-12-04: #17 item 1 at HEAD (windowed commit, stable decode order, fused
# row movers) with interleaved repetitions: the trained model on real text, 16K x 8 (5 reps) and
# 64K x 8 (3 reps), the ratio the median of the paired ones. Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step trained 300 python bench/hisparse_graph_trained.py --device cuda --context 16384 --batch 8 \
  --steps 128 --repeat 5 --commit-every 8 1 --json "$OUT/hisparse_graph_trained_reps_h200.json"
step trained64k 250 python bench/hisparse_graph_trained.py --device cuda --split train \
  --context 65536 --batch 8 --steps 128 --repeat 3 --commit-every 8 \
  --json "$OUT/hisparse_graph_trained_reps_64k_h200.json"
