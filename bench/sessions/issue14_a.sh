#!/usr/bin/env bash
# Issue #14 on the H200, as the issue's user did: four 131,072-token prompts with the same
# first 131,072 bytes (real text: the standard library's sources, newlines as spaces), sent
# together through `shadowradix run`; the summary's prompt hit ratio (ceiling 0.75).
set -u
cd "$(dirname "$0")/../.."
python - "$OUT/prompts.txt" <<'PY'
import os, sys
from pathlib import Path
data = b"".join(f.read_bytes() for f in sorted(Path(os.__file__).parent.rglob("*.py"))[:400])
text = data.decode("utf-8", "replace").replace("\r", " ").replace("\n", " ")
text = "".join(c if c.isascii() and c.isprintable() else " " for c in text)
shared = text[:131072]
with open(sys.argv[1], "w") as f:
    for i in range(4):
        f.write(shared + f" Question {i}: what does the code above do, part {i}?\n")
PY
timeout 170 python -m adapters.cli.main run --model flash-shaped --device cuda --file "$OUT/prompts.txt" \
  --max-new-tokens 32 --chunk-tokens 8192 --full-tokens 1048576 --swa-tokens 65536 \
  > "$OUT/shared_prefix_128k_h200.log" 2> "$OUT/shared_prefix_128k_h200.err"
echo "rc=$?" >> "$OUT/shared_prefix_128k_h200.log"
rm -f "$OUT/prompts.txt"
tail -c 1500 "$OUT/shared_prefix_128k_h200.log"; tail -c 800 "$OUT/shared_prefix_128k_h200.err"
