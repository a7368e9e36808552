#!/usr/bin/env bash
# Device session: where a speculative step's time goes (bench/spec_profile.py) and HiSparse on
# the trained indexer at longer contexts (bench/hisparse_trained.py). Results under $OUT.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
timeout 200 python bench/spec_profile.py --k 2 --json "$OUT/spec_profile_h200.json" > "$OUT/spec_profile.log" 2>&1
echo "spec_profile rc=$?" >> "$OUT/spec_profile.log"
timeout 300 python bench/hisparse_trained.py --device cuda --context 16384 --new-tokens 64 --docs 2 \
  --buffers 33,48,64,96 --json "$OUT/hisparse_trained_h200.json" > "$OUT/hisparse_trained.log" 2>&1
echo "hisparse_trained rc=$?" >> "$OUT/hisparse_trained.log"
