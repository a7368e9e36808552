#!/usr/bin/env bash
# Device session, 2026-12-03: HiSparse graph decode after the cheaper host commit (#17 item 1:
# reused record buffers, bincount ordering, no sort in sync_table): the trained model on real
# text and random weights at 200K x 8, as issue17_c.sh. Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step trained 220 python bench/hisparse_graph_trained.py --device cuda --context 16384 --batch 8 \
  --steps 32 --json "$OUT/hisparse_graph_trained_commit_h200.json"
step random 220 python bench/hisparse_graph.py --context 200000 --batch 8 --steps 20 \
  --out "$OUT/hisparse_graph_commit_h200.json"
