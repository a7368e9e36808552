#!/usr/bin/env bash
# Session 15a (H200): speculative decoding with the trained MTP layer (tiny-trained, held-out
# KJV prompts; k = 1, 2, 3; batch 1, 8, 32), then the budget runner's CUDA case (graph decode
# dropping its captured graphs at each pool resize). Carry data/kjv.
set -u
export PYTHONUNBUFFERED=1
R=${OUT:-bench/results}
timeout 330 python3 bench/speculative.py --model tiny-trained --prompts heldout --device cuda --batches 1,8,32 --ks 1,2,3 --sources mtp,oracle:1.0 --prompt-len 512 --new-tokens 128 --json $R/speculative_trained_h200.json 2>&1 | tee $R/speculative_trained_h200.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_budget_runner.py tests/test_overlap.py 2>&1 | tee $R/budget_overlap_tests_h200.log
