#!/usr/bin/env bash
# Device session, 2026-12-04 (12): HiSparse under graph verify steps (speculation with MTP
# drafts, k = 2) on the trained tiny model, all-resident graph verify against graph verify
# with the C4 KV in HiSparse (20 % buffer), pinned to four cores, interleaved repetitions.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step spec16k 150 taskset -c 2-5 python bench/hisparse_graph_trained.py --device cuda \
  --context 16384 --batch 8 --steps 64 --repeat 3 --commit-every 8 --speculative 2 \
  --json "$OUT/hisparse_graph_spec_16k_h200.json"
step spec200k 260 taskset -c 2-5 python bench/hisparse_graph_trained.py --device cuda \
  --split train --context 200000 --batch 8 --steps 64 --chunk 8192 --repeat 2 \
  --commit-every 8 --speculative 2 --json "$OUT/hisparse_graph_spec_200k_h200.json"
