#!/usr/bin/env bash
# Device session, 2026-12-04 (2): #17 item 1 at 200,000 bytes x 8 on the trained model, where
# the graph step's HiSparse arm lost 0.785x: the step's phases (host timers, CUDA events on the
# replay), the entry hit rate, and a profiled stretch of steps per arm. Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step phases200k 420 python bench/hisparse_graph_trained.py --device cuda --split train \
  --context 200000 --batch 8 --steps 128 --chunk 8192 --commit-every 8 --phases \
  --profile-steps 6 --json "$OUT/hisparse_graph_trained_200k_phases_h200.json"
