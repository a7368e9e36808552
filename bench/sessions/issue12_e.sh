#!/usr/bin/env bash
# Issue #12, GPU call E (the session's last): top-k check, then real prompts at 4K / 128K / 1M
# (bf16, batch 32), 4K / 1M in FP8 (the measured FP8 paths), the torch path at 4K / 128K.
set -u
cd "$(dirname "$0")/../.."
timeout 40 python bench/sessions/topk_check.py > "$OUT/topk_check.log" 2>&1; echo "rc=$?" >> "$OUT/topk_check.log"
timeout 130 python bench/long_context.py --contexts 4096,131072,1048576 --batch 32 --json "$OUT/long_context_bf16_h200.json" > "$OUT/long_context_bf16_h200.log" 2>&1
echo "rc=$?" >> "$OUT/long_context_bf16_h200.log"
timeout 90 python bench/long_context.py --contexts 4096,1048576 --batch 32 --kv-format fp8 --json "$OUT/long_context_fp8_h200.json" > "$OUT/long_context_fp8_h200.log" 2>&1
echo "rc=$?" >> "$OUT/long_context_fp8_h200.log"
timeout 60 python bench/long_context.py --contexts 4096,131072 --paths torch --json "$OUT/long_context_torch_h200.json" > "$OUT/long_context_torch_h200.log" 2>&1
echo "rc=$?" >> "$OUT/long_context_torch_h200.log"
cat "$OUT/topk_check.log"; grep -h '"path"' "$OUT"/long_context_*.log | cut -c1-420; grep -h "compiles,\|rc=" "$OUT"/long_context_*.log
