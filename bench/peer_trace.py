"""SGLang's shared-prefix trace through shadowradix, side by side with SGLang's own caches (CPU).

The workload is exactly that of ``../shared/peers/sglang_swa_driver.py`` (issue #13): the same
token ids (its ``torch.Generator`` seed-0 draws), 2,000 requests in 16 groups, each a 2,048-token
group prefix + 384 unique tokens + 128 decoded tokens, window 128, pools of 400K full / 40K SWA
tokens, page 1, one request at a time. Its lifecycle, through the public API:

    driver (SGLang)                               here
    match_prefix(prompt) + lock                   match_prefix(prompt, len - 1) + admit
    alloc(prompt tail)                            extend(request, prompt_remaining)
    insert(prompt), re-match, move the lock       cache_unfinished(request)
    alloc(128 decode tokens) [evict on OOM]       extend(request, decoded)   (--decode-mode chunk)
    free own out-of-window SWA, release_swa       (extend trims the window itself)
    insert(whole sequence), unlock                finish(request)

``--decode-mode steps`` decodes one token per ``extend_batch`` instead (128 steps: more work
than the driver does). *lazy* leaves each `Allocation`'s slot arrays unbuilt (an engine deriving
slots on the device); *built* touches ``allocation.arrays`` after every extend (a CPU adapter).

The driver runs as a subprocess between our repetitions (interleaved: A, B, peers, A, B, peers,
...), and every figure is the median over repetitions. Ratios are against the best SGLang
hybrid tree core (``UnifiedRadixCache`` with FULL + SWA components, python or rust: the same
job as ours), and, for context, its full-attention-only trees. ``--gc-collect`` starts every
timed run of both sides from a collected heap (SGLang's through `bench/sglang_gc_driver.py`):
otherwise a full collection owed to a harness's setup lands in whichever timed run comes first.

    python bench/peer_trace.py --reps 3 --json bench/results/peer_trace_cpu.json
    python bench/peer_trace.py --reqs 100 --no-peers          # ours only, quick
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.meta import run_meta  # noqa: E402
from shadowradix import CacheConfig, CapacityError, ShadowRadixCache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
PEER_PYTHON = Path.home() / ".cache" / "shadowradix-peers" / "sglang" / "bin" / "python"
#: SGLang rows compared with ours: the hybrid FULL + SWA trees (the same job as ours)
HYBRID = ("unified_swa[python]", "unified_swa[rust]")


@dataclass(frozen=True)
class Workload:
    """The driver's `make_workload` arguments and pool sizes (its defaults for this trace)."""

    reqs: int = 2000
    groups: int = 16
    prefix: int = 2048
    suffix: int = 384
    decode: int = 128
    window: int = 128
    kv_size: int = 400_000
    swa_size: int = 40_000

    @property
    def prompt_len(self) -> int:
        return self.prefix + self.suffix

    def driver_args(self) -> list[str]:
        return [f"--reqs={self.reqs}", f"--groups={self.groups}", f"--prefix={self.prefix}",
                f"--suffix={self.suffix}", f"--decode={self.decode}", f"--window={self.window}",
                f"--kv-size={self.kv_size}", f"--swa-size={self.swa_size}"]  # fmt: skip


@dataclass(frozen=True)
class OurRun:
    arrays: str
    decode: str
    seconds: float
    requests_per_s: float
    hit_ratio: float
    skipped: int
    evicted_full_pages: int
    tombstoned_swa_pages: int


def make_workload(w: Workload) -> list[np.ndarray]:
    """The driver's sequences, token for token (same generator, same draws, same order)."""
    import torch

    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(1, 50_000, (w.prefix,), generator=g) for _ in range(w.groups)]
    seqs = []
    for _ in range(w.reqs):
        p = prefixes[int(torch.randint(0, w.groups, (1,), generator=g))]
        s = torch.randint(1, 50_000, (w.suffix + w.decode,), generator=g)
        seqs.append(np.concatenate((p.numpy(), s.numpy())).astype(np.int64))
    return seqs


def config_for(w: Workload) -> CacheConfig:
    return CacheConfig(page_size=1, window=w.window, full_capacity=w.kv_size,
                       swa_capacity=w.swa_size)  # fmt: skip


def run_ours(w: Workload, seqs: list[np.ndarray], arrays: str, decode: str = "chunk") -> OurRun:
    """Serve ``seqs`` one request at a time; ``arrays`` is ``lazy`` or ``built``."""
    cache = ShadowRadixCache(config_for(w))
    build = arrays == "built"
    n, skipped = w.prompt_len, 0
    steps = np.full((w.decode, 1, 1), 7, dtype=np.int64)
    clock = time.perf_counter
    t0 = clock()
    for seq in seqs:
        prompt, decoded = seq[:n], seq[n:]
        request = cache.admit(prompt, cache.match_prefix(prompt, len(prompt) - 1))
        try:
            alloc = cache.extend(request, request.prompt_remaining)
            if build:
                alloc.arrays  # noqa: B018
            cache.cache_unfinished(request)
            if decode == "chunk":
                alloc = cache.extend(request, decoded)
                if build:
                    alloc.arrays  # noqa: B018
            else:
                for i in range(w.decode):
                    steps[i, 0, 0] = decoded[i]
                    alloc = cache.extend_batch([request], steps[i])
                    if build:
                        alloc.arrays  # noqa: B018
        except CapacityError:
            cache.abort(request)
            skipped += 1
            continue
        cache.finish(request)
    seconds = clock() - t0
    cache.check_invariants()
    stats = cache.stats()
    return OurRun(arrays, decode, seconds, len(seqs) / seconds, stats.hit_ratio, skipped,
                  stats.evicted.full_pages, stats.evicted.swa_pages)  # fmt: skip


_ROW = re.compile(r"^(\S+)\s+core=(\S+)\s+reqs=\d+ wall=\S+ req/s=([\d,]+) prompt_hit=([\d.]+)")


def driver_command(w: Workload, python: Path, peers: Path, gc_collect: bool = False) -> list[str]:
    """The driver's command line; with ``gc_collect`` run through `bench/sglang_gc_driver.py`
    (the same driver, a ``gc.collect()`` before each of its timed runs)."""
    wrap = [str(ROOT / "bench" / "sglang_gc_driver.py")] if gc_collect else []
    driver = str(peers / "sglang_swa_driver.py")
    return [str(python), *wrap, driver, *w.driver_args(), "--backend=both"]


def parse_driver_output(text: str) -> dict[str, dict[str, object]]:
    """The driver's result rows: ``{row name: {core, requests_per_s, hit_ratio, invariants_ok}}``
    (``invariants_ok``: its pool-accounting line and ``sanity_check`` passed)."""
    rows: dict[str, dict[str, object]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _ROW.match(line)
        if m:
            checks = lines[i + 2] if i + 2 < len(lines) else ""
            ok = "False" not in checks and "FAIL" not in checks
            rows[m[1]] = dict(core=m[2], requests_per_s=float(m[3].replace(",", "")),
                              hit_ratio=float(m[4]), invariants_ok=ok)  # fmt: skip
    return rows


def run_driver(cmd: list[str], peers: Path) -> tuple[dict[str, dict[str, object]], str]:
    """One run of the SGLang driver (one torch thread, as ``../shared/peers/README.md`` says)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(peers / "stubs"))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    rows = parse_driver_output(out)
    if not rows:
        raise RuntimeError(f"no result rows in the driver's output:\n{out}")
    return rows, out


def _median_rows(runs: list[dict[str, dict[str, object]]]) -> dict[str, dict[str, object]]:
    out = {}
    for name in runs[0]:
        vals = [float(r[name]["requests_per_s"]) for r in runs if name in r]  # type: ignore[arg-type]
        out[name] = dict(core=runs[0][name]["core"], requests_per_s=statistics.median(vals),
                         reps=vals, hit_ratio=runs[0][name]["hit_ratio"],
                         invariants_ok=all(r[name]["invariants_ok"] for r in runs))  # fmt: skip
    return out


def summarise(
    ours: dict[str, list[OurRun]], peer_runs: list[dict[str, dict[str, object]]]
) -> tuple[dict[str, object], dict[str, dict[str, object]]]:
    """Medians per mode, their ratio to the best hybrid SGLang core's median (and to every
    row's), and the median of the per-repetition ratios (each of ours against the driver run
    right after it: the pairs share the machine's load of the moment)."""
    peers = _median_rows(peer_runs) if peer_runs else {}
    hybrid = [k for k in HYBRID if k in peers]
    best = max(hybrid, key=lambda k: float(peers[k]["requests_per_s"])) if hybrid else None  # type: ignore[arg-type]
    summary: dict[str, object] = {"best_sglang_hybrid": best}
    for mode, runs in ours.items():
        rps = statistics.median(r.requests_per_s for r in runs)
        row: dict[str, object] = dict(requests_per_s=rps, hit_ratio=runs[0].hit_ratio,
                                      reps=[r.requests_per_s for r in runs])  # fmt: skip
        if best is not None:
            row["vs_best_hybrid"] = rps / float(peers[best]["requests_per_s"])  # type: ignore[arg-type]
            pairs = [r.requests_per_s / float(p[best]["requests_per_s"])  # type: ignore[arg-type]
                     for r, p in zip(runs, peer_runs)]  # fmt: skip
            row["vs_best_hybrid_paired_median"] = statistics.median(pairs)
        row["vs"] = {k: rps / float(v["requests_per_s"]) for k, v in peers.items()}  # type: ignore[arg-type]
        summary[mode] = row
    return summary, peers


def print_summary(summary: dict, peers: dict[str, dict[str, object]]) -> None:
    for name, row in peers.items():
        rps, hit = row["requests_per_s"], row["hit_ratio"]
        print(f"  sglang {name:<22} {rps:>8,.0f} req/s  hit {hit:.3f}")
    for mode, row in summary.items():
        if not isinstance(row, dict):
            continue
        ratio = row.get("vs_best_hybrid")
        vs = f"  {ratio:.2f}x {summary['best_sglang_hybrid']}" if ratio else ""
        print(f"  ours   {mode:<22} {row['requests_per_s']:>8,.0f} req/s  "
              f"hit {row['hit_ratio']:.3f}{vs}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in asdict(Workload()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arrays", nargs="*", default=["lazy", "built"], choices=["lazy", "built"])
    ap.add_argument(
        "--decode-mode",
        nargs="*",
        default=["chunk"],
        choices=["chunk", "steps"],
        help="decode in one extend (as the driver allocates it) or token by token",
    )
    ap.add_argument("--no-peers", action="store_true", help="run ours only")
    ap.add_argument("--gc-collect", action="store_true",
                    help="gc.collect() before every timed run, ours and SGLang's")  # fmt: skip
    ap.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    ap.add_argument("--peers-dir", type=Path, default=PEERS)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    meta = run_meta()  # now: the commit and tree that were imported, not those at the end
    w = Workload(**{k: getattr(args, k) for k in asdict(Workload())})
    seqs = make_workload(w)
    modes = [(a, d) for d in args.decode_mode for a in args.arrays]
    cmd = driver_command(w, args.peer_python, args.peers_dir, args.gc_collect)
    ours: dict[str, list[OurRun]] = {}
    peer_runs, peer_log = [], []
    for rep in range(args.reps):
        for arrays, decode in modes:
            if args.gc_collect:
                gc.collect()
            res = run_ours(w, seqs, arrays, decode)
            ours.setdefault(f"{arrays}/{decode}", []).append(res)
            print(f"rep {rep} ours {arrays}/{decode}: {res.requests_per_s:,.0f} req/s "
                  f"hit {res.hit_ratio:.3f} skipped {res.skipped}", flush=True)  # fmt: skip
        if not args.no_peers:
            rows, text = run_driver(cmd, args.peers_dir)
            peer_runs.append(rows)
            peer_log.append(text)
            line = ", ".join(f"{k} {v['requests_per_s']:,.0f}" for k, v in rows.items())
            print(f"rep {rep} sglang: {line}", flush=True)
    summary, peers = summarise(ours, peer_runs)
    print_summary(summary, peers)
    if args.json:
        out = dict(meta=meta, workload=asdict(w), reps=args.reps, gc_collect=args.gc_collect,
                   peer_command=None if args.no_peers else
                   "OMP_NUM_THREADS=1 PYTHONPATH=<peers>/stubs " + " ".join(cmd),
                   summary=summary, sglang=peers,
                   ours={k: [asdict(r) for r in v] for k, v in ours.items()},
                   sglang_output=peer_log)  # fmt: skip
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
