#!/usr/bin/env bash
# Device session after the engine split (#14): the CUDA paths it touched (graph decode/verify
# equivalence, overlap), speculation with the trained MTP layer and the EAGLE head (#15), the
# fused RoPE/RMSNorm kernels on and off, PD between two processes on one GPU (#16). Under $OUT.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> "$OUT/session.log";
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" | tee -a "$OUT/session.log"; }
step gpu_equivalence 70 python bench/gpu_equivalence.py --device cuda
step spec_eagle 200 python bench/speculative.py --model tiny-trained --prompts heldout --device cuda \
  --prompt-len 512 --new-tokens 128 --batches 1,8 --ks 1,2,3 --draft mtp,eagle \
  --json "$OUT/speculative_eagle_h200.json"
step spec_profile_rope 60 python bench/spec_profile.py --k 2 --host-profile --json "$OUT/spec_profile_rope_h200.json"
ADAPTERS_ROPE_KERNELS=0 step spec_profile_norope 45 python bench/spec_profile.py --k 2 \
  --json "$OUT/spec_profile_norope_h200.json"
step runner_overhead 70 python bench/runner_overhead.py --overlap both --reps 2 \
  --json "$OUT/runner_overhead_h200.json"
step pd_transfer 90 python bench/pd_transfer.py --device cuda --prompt-len 32768 --reps 3 \
  --json "$OUT/pd_transfer_h200.json"
