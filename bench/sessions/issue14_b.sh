#!/usr/bin/env bash
# Session 14b (H200): overlap scheduling's host share (batch 32 and 1, interleaved A/B), the GPU
# equivalence check (overlapped by default now), then a decode-context spot check after the
# graph metadata / block-table change. Run from an extracted snapshot with SHADOWRADIX_COMMIT set.
set -u
export PYTHONUNBUFFERED=1
R=${OUT:-bench/results}
timeout 240 python3 bench/runner_overhead.py --batch 32 --prompt-len 4096 --steps 50 --overlap both --reps 3 --json $R/runner_overlap_h200_b32.json 2>&1 | tee $R/runner_overlap_h200_b32.log
timeout 120 python3 bench/gpu_equivalence.py --device cuda 2>&1 | tee $R/gpu_equivalence_h200_overlap.log
timeout 120 python3 bench/runner_overhead.py --batch 1 --prompt-len 4096 --steps 50 --overlap both --reps 3 --json $R/runner_overlap_h200_b1.json 2>&1 | tee $R/runner_overlap_h200_b1.log
timeout 90 python3 bench/decode_context.py --steps 20 --contexts 4096,262144 --eager-contexts "" 2>&1 | tee $R/decode_context_h200_slots.log
