#!/usr/bin/env bash
# Device session, 2026-12-04: HiSparse graph decode with its row movers fused into one kernel
# each (adapters/kernels/hisparse_step.py) after the windowed commit and the stable decode order
# (#17 item 1): the trained model on real text (16K and 64K bytes x 8) and random weights at
# 200K x 8, as issue17_e.sh. Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step trained 200 python bench/hisparse_graph_trained.py --device cuda --context 16384 --batch 8 \
  --steps 64 --phases --commit-every 8 1 32 --json "$OUT/hisparse_graph_trained_fused_h200.json"
step trained64k 250 python bench/hisparse_graph_trained.py --device cuda --split train \
  --context 65536 --batch 8 --steps 64 --phases --commit-every 8 1 \
  --json "$OUT/hisparse_graph_trained_fused_64k_h200.json"
step random 200 python bench/hisparse_graph.py --context 200000 --batch 8 --steps 40 \
  --commit-every 8 1 --out "$OUT/hisparse_graph_fused_h200.json"
