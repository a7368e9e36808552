#!/usr/bin/env bash
# Device session, 2026-12-04 (9): after the commit queues its table changes with its copies and
# the copy kernels load at construction: the random-weights flash-shaped 200K x 8 step by step,
# and the trained model at 200K x 8, three interleaved repetitions; both pinned to four cores.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step random200k_after 200 taskset -c 2-5 python bench/hisparse_graph.py --context 200000 \
  --batch 8 --steps 40 --commit-every 8 --out "$OUT/hisparse_graph_random_200k_after_h200.json"
step trained200k_after 400 taskset -c 2-5 python bench/hisparse_graph_trained.py --device cuda \
  --split train --context 200000 --batch 8 --steps 128 --chunk 8192 --commit-every 8 \
  --probe 30 --repeat 3 --json "$OUT/hisparse_graph_trained_200k_after_h200.json"
