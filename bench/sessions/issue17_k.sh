#!/usr/bin/env bash
# Device session, 2026-12-04 (4): issue17_j found the HiSparse graph's launch host time growing
# with the pool (16K context in pools sized for 200K: 0.28 ms; 16K pools: 0.026; all-resident
# 0.01): a graph whose kernel reads mapped pinned memory, by the memory's size and allocation
# kind (bench/mapped_launch.py). Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
(nvidia-smi -q | grep -i -A3 "confidential\|addressing\|virtualization"; cat /sys/kernel/mm/transparent_hugepage/enabled) >> "$OUT/session.log" 2>&1
step mapped_launch 240 python bench/mapped_launch.py --sizes-mib 4 64 512 2048 \
  --json "$OUT/mapped_launch_h200.json"
