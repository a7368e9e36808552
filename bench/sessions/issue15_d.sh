#!/usr/bin/env bash
# Device session: train the tiny-shared-trained preset (tail-only quality) and the EAGLE head of
# tiny-trained (a second draft source), shipping both files. Results under $OUT.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" train_out
timeout 290 python -m adapters.train --device cuda --preset tiny-shared-trained --budget-minutes 4 \
  --ship --checkpoint train_out/tiny-shared-trained.pt --log "$OUT/train_tiny_shared_trained_h200.json" \
  > "$OUT/train_tiny_shared_trained_h200.log" 2>&1
echo "shared rc=$?" >> "$OUT/train_tiny_shared_trained_h200.log"
timeout 230 python -m adapters.train --device cuda --eagle --budget-minutes 3 \
  --ship --checkpoint train_out/tiny-trained-eagle.pt --log "$OUT/train_tiny_trained_eagle_h200.json" \
  > "$OUT/train_tiny_trained_eagle_h200.log" 2>&1
echo "eagle rc=$?" >> "$OUT/train_tiny_trained_eagle_h200.log"
cp adapters/model/trained/*.safetensors "$OUT/" 2>/dev/null
ls -la "$OUT"
