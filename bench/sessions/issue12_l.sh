#!/usr/bin/env bash
# Issue #12, GPU call L: the FP8 indexer with e4m3 queries (Fp8Mode.FP8_Q, a90b64b) checked and
# timed among the FP8 key paths and in the shared-prefix decode; then bf16 and FP8 side by side
# through the runner at 4K and 1M (batch 1 and 32) with it and the stream-length change.
set -u
cd "$(dirname "$0")/../.."
timeout 200 python bench/indexer.py --no-sweep --only "shared prefix" \
  --json "$OUT/indexer_shared_q8_h200.json" > "$OUT/indexer_shared_q8_h200.log" 2>&1
echo "rc=$?" >> "$OUT/indexer_shared_q8_h200.log"
grep -h "check\|shared prefix, split\|shared prefix,\|rc=" "$OUT/indexer_shared_q8_h200.log" | grep -v '^ *"' | cut -c1-200 | tail -20
timeout 170 python bench/indexer.py --fp8-candidates \
  --json "$OUT/indexer_fp8_q_candidates_h200.json" > "$OUT/indexer_fp8_q_candidates_h200.log" 2>&1
echo "rc=$?" >> "$OUT/indexer_fp8_q_candidates_h200.log"
grep -h "FP8_Q\|bf16 keys  \|STAGED_F16\|rc=" "$OUT/indexer_fp8_q_candidates_h200.log" | grep -v '^ *"' | cut -c1-200 | tail -24
timeout 330 python bench/long_context.py --contexts 4096,1048576 --batch 32 --kv-format bf16,fp8 \
  --json "$OUT/long_context_fp8q_h200.json" > "$OUT/long_context_fp8q_h200.log" 2>&1
echo "rc=$?" >> "$OUT/long_context_fp8q_h200.log"
grep -h '"path"\|rc=' "$OUT/long_context_fp8q_h200.log" | python3 -c "
import sys, json
for line in sys.stdin:
    line = line.strip()
    if line.startswith('{'):
        r = json.loads(line)
        print({k: r.get(k) for k in ('kv_format', 'context', 'ttft_s', 'decode_tokens_per_s', 'batch_decode_tokens_per_s', 'peak_gib')})
    else:
        print(line)
"
