"""Render bench/trace_replay.py's JSON as the markdown table used in docs/benchmarks.md.

python bench/report.py bench/results/trace_replay.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def render(rows: list[dict]) -> str:
    out = [
        "| page | full / SWA tokens | replay | CPU arrays | req/s | decode tok/s "
        "| prompt hit ratio | µs per token (decode) "
        "| µs match / admit / prefill / cache_unfinished / finish |",
        "|---:|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ops = r["op_us"]
        names = ("match", "admit", "prefill", "cache_unfinished", "finish")
        per_req = " / ".join(f"{ops.get(k, 0):.0f}" for k in names)
        out.append(
            f"| {r['page_size']} | {r['full_tokens']:,} / {r['swa_tokens']:,} | "
            f"{'on' if r['replay'] else 'off'} | {'built' if r['materialized'] else 'lazy'} | "
            f"{r['requests_per_s']:,.0f} | {r['decode_tokens_per_s']:,.0f} | "
            f"{r['hit_ratio']:.3f} | "
            f"{ops.get('decode_token', 0):.1f} | {per_req} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1]).read_text())))
