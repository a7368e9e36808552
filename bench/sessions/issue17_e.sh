#!/usr/bin/env bash
# Device session, 2026-12-04: HiSparse graph decode planning once a window of commit_every graph
# steps (#17 item 1): the trained model on real text (16K and 64K bytes x 8), random weights at
# 200K x 8, the host commit cost on this host's CPU, and the capacity at a fixed budget with the
# graph residency's per-page tensors (re-run after the stable decode order; --phases). Under $OUT. Two device calls: PART=1, then PART=2.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
if [ "${PART:-1}" = 1 ]; then
step trained 200 python bench/hisparse_graph_trained.py --device cuda --context 16384 --batch 8 \
  --steps 64 --phases --commit-every 8 1 4 16 32 --json "$OUT/hisparse_graph_trained_window_h200.json"
step trained64k 330 python bench/hisparse_graph_trained.py --device cuda --split train \
  --context 65536 --batch 8 --steps 64 --phases --commit-every 8 1 32 \
  --json "$OUT/hisparse_graph_trained_window_64k_h200.json"
else
step random 300 python bench/hisparse_graph.py --context 200000 --batch 8 --steps 40 \
  --commit-every 8 1 --out "$OUT/hisparse_graph_window_h200.json"
step commit1 120 python bench/hisparse_commit.py --commit-every 1 \
  --json "$OUT/hisparse_commit_h200host_every1.json"
step commit8 120 python bench/hisparse_commit.py --commit-every 8 \
  --json "$OUT/hisparse_commit_h200host_every8.json"
step capacity 200 python bench/hisparse_decode.py --skip-decode --budget-gib 64 \
  --json "$OUT/hisparse_capacity_window_h200.json"
fi
