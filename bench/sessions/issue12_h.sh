#!/usr/bin/env bash
# Issue #12, GPU call H: where an FP8 decode step loses to bf16 (batch 1, 4K, both formats), and
# where a batch-32 decode step at 1M spends its time with the shared-prefix indexer.
set -u
cd "$(dirname "$0")/../.."
for f in bf16 fp8; do
  timeout 70 python bench/profile_runner.py --context 4096 --profile-chunks 0 --kv-format $f --out "$OUT/p4k_$f" > "$OUT/p4k_$f.log" 2>&1
done
timeout 200 python bench/profile_runner.py --context 1048576 --batch 32 --profile-chunks 0 --decode-steps 4 --out "$OUT/p1m_b32" > "$OUT/p1m_b32.log" 2>&1; echo "rc=$?" >> "$OUT/p1m_b32.log"
rm -f "$OUT"/p*/*_host.txt
grep -E "== decode|warm ms|rc=" "$OUT"/p*.log | cut -c1-300
