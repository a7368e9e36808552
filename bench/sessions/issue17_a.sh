#!/usr/bin/env bash
# Device session, 2026-12-02 evening, call A (no new code): Engram decode throughput per
# placement (#17 item 5), and why bench/quality.py and bench/hisparse_trained.py produce nothing
# on CUDA within minutes (#15: stacks dumped every 45 s, Triton compilations watched). Under $OUT.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> "$OUT/session.log";
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" | tee -a "$OUT/session.log"; }
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/session.log"
step engram 150 python bench/engram.py --device cuda --preset flash-engram --engram-rows 4000000 \
  --batch 8 --new 64 --reps 3 --out "$OUT/engram_gpu.json"

step hisparse_trained_watch 100 python bench/sessions/stacks.py bench/hisparse_trained.py --device cuda --models tiny-trained \
  --docs 1 --context 4096 --new-tokens 16 --buffers 48 --compile-watch --json "$OUT/hisparse_trained_gpu.json"
step quality_stacks 100 python bench/sessions/stacks.py bench/quality.py --device cuda --exact-docs 1 --exact-bytes 512 \
  --long-docs 1 --long-bytes 2048 --greedy-tokens 16 --json "$OUT/quality_gpu.json"
