#!/usr/bin/env bash
# Issue #12, GPU call M (HEAD after 1/8-octave buckets, stream lengths without masks, 16-bit
# indexer q): bf16 and FP8 side by side at 4K and 1M (batch 1 and 32); then the runner against
# the dense reference on the GPU (fp32, graphs on and off).
set -u
cd "$(dirname "$0")/../.."
timeout 330 python bench/long_context.py --contexts 4096,1048576 --batch 32 --kv-format bf16,fp8 \
  --json "$OUT/long_context_final_h200.json" > "$OUT/long_context_final_h200.log" 2>&1
echo "rc=$?" >> "$OUT/long_context_final_h200.log"
grep -h '"path"\|rc=' "$OUT/long_context_final_h200.log" | python3 -c "
import sys, json
for line in sys.stdin:
    line = line.strip()
    if line.startswith('{'):
        r = json.loads(line)
        print({k: r.get(k) for k in ('kv_format', 'context', 'ttft_s', 'decode_tokens_per_s', 'batch_decode_tokens_per_s', 'peak_gib')})
    else:
        print(line)
"
timeout 200 python bench/gpu_equivalence.py --device cuda --dtypes float32 > "$OUT/gpu_equivalence_final_h200.log" 2>&1
echo "equivalence rc=$?" >> "$OUT/gpu_equivalence_final_h200.log"
tail -c 2500 "$OUT/gpu_equivalence_final_h200.log"
