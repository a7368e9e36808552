#!/usr/bin/env bash
# Device session, 2026-12-03: HiSparse in CUDA graphs on real attention (#17 item 1): the
# trained tiny model over real held-out KJV text, all-resident vs a 20 % buffer. Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step hisparse_graph_trained 420 python bench/sessions/stacks.py bench/hisparse_graph_trained.py \
  --device cuda --context 16384 --batch 8 --steps 32 --json "$OUT/hisparse_graph_trained_h200.json"
