#!/usr/bin/env bash
# Issue #12, GPU call B: which Triton kernels compile during a 4K then a 128K prompt.
set -u
timeout 200 python bench/long_context.py --contexts 4096,131072 --new-tokens 16 --json "$OUT/long_context_watch.json" > "$OUT/long_context_watch.log" 2>&1
echo "rc=$?" >> "$OUT/long_context_watch.log"
