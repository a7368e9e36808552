"""Plots bench/results/decode_context_h200.json (decode tokens/s versus context length)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(
    src: str = "bench/results/decode_context_h200.json",
    dst: str = "docs/img/decode_context_h200.png",
) -> int:
    rows = [r for r in json.loads(Path(src).read_text()) if r["graphs"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for batch in sorted({r["batch"] for r in rows}):
        pts = sorted((r["context"], r["tokens_per_s"]) for r in rows if r["batch"] == batch)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"batch {batch}")
        base = pts[0][1]
        for c, v in pts:
            ax.annotate(
                f"{v / base:.0%}",
                (c, v),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tokens/s (CUDA graphs)")
    ax.set_title("flash-shaped preset (4 layers, 64 heads x 512-d latent), H200")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=110)
    print(dst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
