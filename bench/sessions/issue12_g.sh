#!/usr/bin/env bash
# Issue #12, GPU call G: the shared-prefix indexer split side by side (B 32 decode, bf16 and
# FP8 keys); 128K prefill after a warm-up through the same pools; 1M batch-32 decode in bf16
# and FP8 (real prompts, one process per table).
set -u
cd "$(dirname "$0")/../.."
timeout 130 python bench/indexer.py --no-sweep --only B32 --json "$OUT/indexer_b32_h200.json" > "$OUT/indexer_b32_h200.log" 2>&1; echo "rc=$?" >> "$OUT/indexer_b32_h200.log"
timeout 110 python bench/long_context.py --contexts 4096,131072 --warm --batch 32 --json "$OUT/long_context_warm_h200.json" > "$OUT/long_context_warm_h200.log" 2>&1; echo "rc=$?" >> "$OUT/long_context_warm_h200.log"
timeout 150 python bench/long_context.py --contexts 4096,1048576 --batch 32 --json "$OUT/long_context_bf16_h200.json" > "$OUT/long_context_bf16_h200.log" 2>&1; echo "rc=$?" >> "$OUT/long_context_bf16_h200.log"
timeout 150 python bench/long_context.py --contexts 4096,1048576 --batch 32 --kv-format fp8 --json "$OUT/long_context_fp8_h200.json" > "$OUT/long_context_fp8_h200.log" 2>&1; echo "rc=$?" >> "$OUT/long_context_fp8_h200.log"
grep -E "check .*FAIL|ERROR|kernel decode|checks ok|rc=" "$OUT/indexer_b32_h200.log" | cut -c1-300
grep -h '"path"\|rc=' "$OUT"/long_context_*.log | cut -c1-700
grep -h -A6 "compiles," "$OUT"/long_context_warm_h200.log | cut -c1-300
