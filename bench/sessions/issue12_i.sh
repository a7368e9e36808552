#!/usr/bin/env bash
# Issue #12, GPU call I: the fused FP8 store against the torch chain (bytes equal, µs eager and
# in graphs); then bf16 and FP8 side by side in one process at 4K and 1M (batch 1 and 32).
set -u
cd "$(dirname "$0")/../.."
timeout 60 python bench/quantize.py --json "$OUT/quantize_h200.json" > "$OUT/quantize_h200.log" 2>&1
rc=$?; echo "rc=$rc" >> "$OUT/quantize_h200.log"
if [ $rc -ne 0 ]; then tail -c 3000 "$OUT/quantize_h200.log"; exit 1; fi
timeout 330 python bench/long_context.py --contexts 4096,1048576 --batch 32 --kv-format bf16,fp8 --json "$OUT/long_context_formats_h200.json" > "$OUT/long_context_formats_h200.log" 2>&1; echo "rc=$?" >> "$OUT/long_context_formats_h200.log"
cut -c1-400 "$OUT/quantize_h200.log"
grep -h '"path"\|rc=' "$OUT"/long_context_*.log | cut -c1-900
