#!/usr/bin/env bash
# Device session, 2026-12-04 (10): the trained model at 16K and 64K x 8 after 46a5869 (the
# commit's table changes queued with its copies, copy kernels loaded at construction), pinned
# to four cores like issue17_m/p, three interleaved repetitions each.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step trained16k_after 150 taskset -c 2-5 python bench/hisparse_graph_trained.py --device cuda \
  --context 16384 --batch 8 --steps 128 --repeat 3 --commit-every 8 --probe 30 \
  --json "$OUT/hisparse_graph_trained_16k_after_h200.json"
step trained64k_after 200 taskset -c 2-5 python bench/hisparse_graph_trained.py --device cuda \
  --split train --context 65536 --batch 8 --steps 128 --repeat 3 --commit-every 8 --probe 30 \
  --json "$OUT/hisparse_graph_trained_64k_after_h200.json"
