"""Render a result file as the markdown table docs/benchmarks.md shows for it:
bench/trace_replay.py's rows, or bench/long_context.py's (one row per prompt and cache format,
ratios to the 4K prompt of the same format and FP8 against bf16).

python bench/report.py bench/results/trace_replay.json
python bench/report.py bench/results/long_context_final_h200.json
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


def render_long_context(rows: list[dict]) -> str:
    out = [
        "| prompt | format | TTFT s (compiling) | prefill tok/s | decode tok/s (× 4K) "
        "| batch-32 tok/s (× 4K) | peak GiB |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    base = {r["kv_format"]: r for r in rows if r["context"] == min(x["context"] for x in rows)}
    for r in rows:
        b, fmt = base.get(r["kv_format"]), r.get("kv_format", "bf16")
        dec, bat = r.get("decode_tokens_per_s"), r.get("batch_decode_tokens_per_s")
        d_ratio = f" ({dec / b['decode_tokens_per_s']:.2f})" if b and b is not r and dec else ""
        b_ratio = (f" ({bat / b['batch_decode_tokens_per_s']:.3f})"
                   if b and b is not r and bat else "")  # fmt: skip
        comp = r.get("triton_compile_s") or 0
        out.append(
            f"| {r['context']:,} | {fmt} | {r['ttft_s']:.1f} ({comp:.1f}) | "
            f"{r['prefill_tokens_per_s']:,.0f} | {dec:,.1f}{d_ratio} | "
            + (f"{bat:,.0f}{b_ratio}" if bat else "-")
            + f" | {r['peak_gib']:.1f} |"
        )
    return "\n".join(out)


def report(data: object) -> str:
    """The table of a trace_replay (a list of rows) or long_context (``rows``) result."""
    rows = data.get("rows") if isinstance(data, dict) else data  # older files: the bare rows
    if isinstance(rows, list) and rows and "kv_format" in rows[0]:
        return render_long_context(rows)
    if isinstance(rows, list) and rows and "op_us" in rows[0]:
        return render(rows)
    raise SystemExit("not a bench/trace_replay.py or bench/long_context.py result")


if __name__ == "__main__":
    print(report(json.loads(Path(sys.argv[1]).read_text())))
