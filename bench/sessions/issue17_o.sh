#!/usr/bin/env bash
# Device session, 2026-12-04 (8): the random-weights flash-shaped 200K x 8 step by step: every
# step's time per arm, each commit's host time and its mirror -> buffer copies' device time
# (is the mean's excess over the median the copies, serialised after the commit's step?).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step random200k_steps 200 taskset -c 2-5 python bench/hisparse_graph.py --context 200000 \
  --batch 8 --steps 40 --commit-every 8 --out "$OUT/hisparse_graph_random_200k_steps_h200.json"
