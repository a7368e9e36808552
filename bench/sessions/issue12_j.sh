#!/usr/bin/env bash
# Issue #12, GPU call J: where FP8 loses to bf16. The decode step profiled kernel by kernel in
# both formats, batch 1 at 4K (the gap is there too) and batch 32 over a shared 1M prompt.
set -u
cd "$(dirname "$0")/../.."
run() {  # label, args...
  local label=$1; shift
  timeout 200 python bench/profile_runner.py --profile-chunks 0 --out "$OUT/$label" "$@" \
    > "$OUT/$label.log" 2>&1
  echo "rc=$?" >> "$OUT/$label.log"
  grep -h "GPU ms\|step ms\|rc=" "$OUT/$label.log"
}
run profile_4k_bf16 --context 4096 --decode-steps 8 --kv-format bf16
run profile_4k_fp8 --context 4096 --decode-steps 8 --kv-format fp8
run profile_1m_b32_fp8 --context 1048576 --batch 32 --decode-steps 4 --kv-format fp8
run profile_1m_b32_bf16 --context 1048576 --batch 32 --decode-steps 4 --kv-format bf16
