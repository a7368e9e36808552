#!/usr/bin/env bash
# Issue #12, GPU call A: equivalence, then one real prompt at 4K / 128K / 1M through the runner.
set -u
export SHADOWRADIX_COMMIT="${SHADOWRADIX_COMMIT:-unknown}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia_smi.txt" 2>&1
timeout 110 python bench/gpu_equivalence.py --device cuda --dtypes float32 > "$OUT/gpu_equivalence.log" 2>&1
echo "equivalence rc=$?" >> "$OUT/gpu_equivalence.log"
timeout 430 python bench/long_context.py --contexts 4096,131072,1048576 --json "$OUT/long_context_b1.json" > "$OUT/long_context_b1.log" 2>&1
echo "long_context rc=$?" >> "$OUT/long_context_b1.log"
tail -5 "$OUT"/*.log
