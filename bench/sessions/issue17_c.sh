#!/usr/bin/env bash
# Device session, 2026-12-03: HiSparse graph decode with the commit after the launch (#17
# item 1): random weights at 200K x 8 and the trained model on real text. Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step trained 200 python bench/hisparse_graph_trained.py --device cuda --context 16384 --batch 8 \
  --steps 32 --json "$OUT/hisparse_graph_trained_deferred_h200.json"
step random 200 python bench/hisparse_graph.py --context 200000 --batch 8 --steps 20 \
  --out "$OUT/hisparse_graph_deferred_h200.json"
