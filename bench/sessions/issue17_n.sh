#!/usr/bin/env bash
# Device session, 2026-12-04 (7): the random-weights flash-shaped 200K x 8 (bus-bound: ~80 % of
# entries outside the buffer), three runs pinned to four cores, after most_read's partition
# (73b30a7); and the commit's host time before (OLD: a tree of 3a7e777) and after, interleaved.
# Under $OUT.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/lib.sh
for r in 1 2 3; do
  step random200k_$r 200 taskset -c 2-5 python bench/hisparse_graph.py --context 200000 \
    --batch 8 --steps 40 --commit-every 8 --out "$OUT/hisparse_graph_random_200k_run${r}_h200.json"
done
if [ -n "${OLD:-}" ]; then
  for r in 1 2; do
    step commit_old_$r 200 taskset -c 2-5 python "$OLD/bench/hisparse_commit.py" --commit-every 8 \
      --scenarios random local --repeat 2 --json "$OUT/hisparse_commit_old_$r.json"
    step commit_new_$r 200 taskset -c 2-5 python bench/hisparse_commit.py --commit-every 8 \
      --scenarios random local --repeat 2 --json "$OUT/hisparse_commit_new_$r.json"
  done
fi
