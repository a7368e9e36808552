# Sourced by the device session scripts (bench/sessions/issue*.sh from 2026-12-03 on; the earlier
# scripts stay as they ran). Defines OUT (created) and `step NAME TIMEOUT CMD...`: runs CMD under
# `timeout`, its output in $OUT/NAME.log, its rc appended to $OUT/session.log; and records the GPU.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() {
  local name=$1 t=$2; shift 2
  echo "== $name: $*" >> "$OUT/session.log"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/session.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/session.log" 2>&1 || true
