#!/usr/bin/env bash
# Issue #12, GPU call F: the runner still equals the reference on the GPU after the hc_mix fold
# and the device-built windows; a 128K prefill step's profile; 128K prefill after a warm-up;
# where a batch-32 decode step at 1M context spends its time.
set -u
cd "$(dirname "$0")/../.."
timeout 60 python bench/gpu_equivalence.py --dtypes float32 > "$OUT/gpu_equivalence.log" 2>&1; echo "rc=$?" >> "$OUT/gpu_equivalence.log"
timeout 90 python bench/profile_runner.py --context 131072 --out "$OUT/p128k" > "$OUT/p128k.log" 2>&1
timeout 120 python bench/long_context.py --contexts 4096,131072 --warm --batch 32 --json "$OUT/long_context_warm_h200.json" > "$OUT/long_context_warm_h200.log" 2>&1; echo "rc=$?" >> "$OUT/long_context_warm_h200.log"
timeout 220 python bench/profile_runner.py --context 1048576 --batch 32 --profile-chunks 0 --decode-steps 4 --out "$OUT/p1m_b32" > "$OUT/p1m_b32.log" 2>&1; echo "rc=$?" >> "$OUT/p1m_b32.log"
tail -n 4 "$OUT/gpu_equivalence.log"
grep -E "==|steps ms|warm ms" "$OUT"/p*.log | cut -c1-600
grep -h '"path"\|rc=' "$OUT"/long_context_*.log | cut -c1-700
