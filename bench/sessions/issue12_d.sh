#!/usr/bin/env bash
# Issue #12, GPU call D: the mHC launch sweep, where a 128K prefill step and a batch-32 decode
# step at 1M context spend their time, and the five FP8 indexer key paths.
set -u
cd "$(dirname "$0")/../.."
timeout 60 python bench/hc.py --json "$OUT/hc_sweep_h200.json" > "$OUT/hc_sweep_h200.log" 2>&1
timeout 80 python bench/profile_runner.py --context 131072 --out "$OUT/p128k" > "$OUT/p128k.log" 2>&1
timeout 100 python bench/profile_runner.py --context 1048576 --batch 32 --profile-chunks 0 --out "$OUT/p1m_b32" > "$OUT/p1m_b32.log" 2>&1
timeout 150 python bench/indexer.py --fp8-candidates --json "$OUT/indexer_fp8_candidates_h200.json" > "$OUT/indexer_fp8_candidates_h200.log" 2>&1
echo "rc=$?" >> "$OUT/indexer_fp8_candidates_h200.log"
grep -E "==|steps ms|warm ms" "$OUT"/p*.log | cut -c1-600
tail -n 12 "$OUT/indexer_fp8_candidates_h200.log"
