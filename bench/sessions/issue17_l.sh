#!/usr/bin/env bash
# Device session, 2026-12-04 (5): bench/mapped_launch.py found no launch cost growing with mapped
# memory, yet in issue17_i/j every host phase of the HiSparse arm ran slower (uploads 1.5-2x).
# At 200K x 8: the HiSparse arm first, two interleaved repetitions, and after each arm's timed
# steps its last graph replayed alone (launch host time, replay wall) next to a fixed host-only
# workload. Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step probe200k 420 python bench/hisparse_graph_trained.py --device cuda --split train \
  --context 200000 --batch 8 --steps 64 --chunk 8192 --commit-every 8 --phases --probe 50 \
  --hisparse-first --repeat 2 --json "$OUT/hisparse_graph_trained_200k_probe_h200.json"
