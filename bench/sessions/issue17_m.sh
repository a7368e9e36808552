#!/usr/bin/env bash
# Device session, 2026-12-04 (6): issue17_l showed the host itself running at two speeds
# between arms (a fixed host-only workload 0.50 vs 0.81-0.88 ms, arm for arm), the replay's
# device time equal across arms (1.16-1.22 ms). The process pinned to four cores
# (taskset), 200K x 8 on the trained model, five interleaved repetitions with the host probe;
# then the random-weights flash-shaped 200K x 8, pinned the same way. Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
(nproc; lscpu | grep -i "numa\|model name\|mhz") >> "$OUT/session.log" 2>&1
step trained200k_pinned 420 taskset -c 2-5 python bench/hisparse_graph_trained.py --device cuda \
  --split train --context 200000 --batch 8 --steps 128 --chunk 8192 --commit-every 8 \
  --probe 30 --repeat 5 --json "$OUT/hisparse_graph_trained_200k_reps_h200.json"
step random200k_pinned 240 taskset -c 2-5 python bench/hisparse_graph.py --context 200000 \
  --batch 8 --steps 40 --commit-every 8 --out "$OUT/hisparse_graph_random_200k_pinned_h200.json"
