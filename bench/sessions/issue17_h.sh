#!/usr/bin/env bash
# Device session, 2026-12-04: #17 item 1 at the target's context and batch, 200,000 bytes x 8,
# on the trained model (tiny-trained, real training-split KJV text; no trained flash-shaped
# weights exist), commit every 8. Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step trained200k 280 python bench/hisparse_graph_trained.py --device cuda --split train \
  --context 200000 --batch 8 --steps 128 --chunk 8192 --commit-every 8 \
  --json "$OUT/hisparse_graph_trained_200k_h200.json"
