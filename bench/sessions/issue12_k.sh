#!/usr/bin/env bash
# Issue #12, GPU call K: 1/8-octave decode context buckets (704a3be). bf16 and FP8 side by side
# at 4K and 1M (batch 1 and 32), then the batch-32 1M decode step profiled kernel by kernel.
set -u
cd "$(dirname "$0")/../.."
timeout 400 python bench/long_context.py --contexts 4096,1048576 --batch 32 --kv-format bf16,fp8 \
  --json "$OUT/long_context_buckets_h200.json" > "$OUT/long_context_buckets_h200.log" 2>&1
echo "rc=$?" >> "$OUT/long_context_buckets_h200.log"
grep -h '"path"\|rc=' "$OUT"/long_context_buckets_h200.log | cut -c1-900
timeout 150 python bench/profile_runner.py --profile-chunks 0 --out "$OUT/profile_1m_b32_buckets" \
  --context 1048576 --batch 32 --decode-steps 4 --kv-format bf16 > "$OUT/profile_1m_b32_buckets.log" 2>&1
echo "rc=$?" >> "$OUT/profile_1m_b32_buckets.log"
grep -h "GPU ms\|step ms\|rc=" "$OUT/profile_1m_b32_buckets.log"
