#!/usr/bin/env bash
# Issue #12, GPU call C: the mHC kernels, then real prompts at 4K / 128K / 1M (bf16, batch 32),
# 4K / 1M in FP8, with every Triton compile logged; the FP8 indexer candidates if time is left.
set -u
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia_smi.txt" 2>&1
if ! timeout 60 python bench/hc.py --json "$OUT/hc_h200.json" > "$OUT/hc_h200.log" 2>&1; then
  echo "mHC kernels failed their check: the runs below use the torch references" >> "$OUT/hc_h200.log"
  export ADAPTERS_HC_KERNELS=0
fi
timeout 90 python bench/gpu_equivalence.py --device cuda --dtypes float32 > "$OUT/gpu_equivalence.log" 2>&1
echo "rc=$?" >> "$OUT/gpu_equivalence.log"
timeout 230 python bench/long_context.py --contexts 4096,131072,1048576 --batch 32 --json "$OUT/long_context_bf16.json" > "$OUT/long_context_bf16.log" 2>&1
echo "rc=$?" >> "$OUT/long_context_bf16.log"
timeout 130 python bench/long_context.py --contexts 4096,1048576 --batch 32 --kv-format fp8 --json "$OUT/long_context_fp8.json" > "$OUT/long_context_fp8.log" 2>&1
echo "rc=$?" >> "$OUT/long_context_fp8.log"
tail -n 3 "$OUT"/*.log
