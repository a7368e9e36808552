#!/usr/bin/env bash
# Device session, 2026-12-04 (3): where the HiSparse graph step's extra time at 200K x 8 goes.
# issue17_i found the replay's host launch 0.24 ms (0.013 all-resident; 0.026 at 16K) and the
# replay's device time +0.24 ms with equal kernel time: the device's gaps between kernels and
# each cudaGraphLaunch's host time per arm, at 200K, and at 16K context in pools sized for 200K
# (pool size or context?). Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
step gaps200k 300 python bench/hisparse_graph_trained.py --device cuda --split train \
  --context 200000 --batch 8 --steps 64 --chunk 8192 --commit-every 8 --phases \
  --profile-steps 6 --json "$OUT/hisparse_graph_trained_200k_gaps_h200.json"
step pool200k_ctx16k 200 python bench/hisparse_graph_trained.py --device cuda --split train \
  --context 16384 --pool-context 200000 --batch 8 --steps 64 --chunk 8192 --commit-every 8 \
  --phases --profile-steps 6 --json "$OUT/hisparse_graph_trained_16k_pool200k_h200.json"
