#!/usr/bin/env bash
# Device session, 2026-12-02 evening, call B: the speculative step's host path vs device drafts
# (#15, bench/spec_ab.py, one process, interleaved), Engram placements' decode (#17 item 5).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> "$OUT/session.log";
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" | tee -a "$OUT/session.log"; }
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/session.log"
step spec_ab 230 python bench/spec_ab.py --json "$OUT/spec_ab_gpu.json"
step engram 170 python bench/engram.py --device cuda --preset flash-engram --engram-rows 4000000 \
  --batch 8 --new 64 --reps 3 --out "$OUT/engram_gpu.json"
