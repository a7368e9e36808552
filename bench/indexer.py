"""The fused Lightning indexer (`adapters.kernels.indexer.flash_index_logits`) on one GPU
(made for an H200), against the reference and against the old einsum path.

    python bench/indexer.py [--json PATH] [--budget SECONDS] [--no-sweep]
    python bench/indexer.py --smoke          # CPU, Triton interpreter, tiny shapes

1. Checks on CUDA: the kernel against `index_logits_reference` (fp32 maths on the same inputs)
   for the decode shape (one row set per query, page table, slots_per_page 16, and a slot
   table) and the prefill shape (queries of one request sharing its row set, causal lengths
   ``(pos + 1) // 4``; also row sets that change inside a block), bf16 and FP8 keys, and the
   other dtype mixes (fp32 q, fp16, fp32 keys) at smaller sizes. A check passes when the -inf
   positions are equal and the relative L2 error is below 1e-5.
2. Timings, side by side in this process: eager (CUDA events around one call, median) and
   inside a CUDA graph (replays of back-to-back calls, median per call; at B = 1 the calls
   alternate between two pools so that the 64 MiB of keys do not stay in L2), the kernel vs
   the old path ``ops.index_scores(q, w, keys[slots])`` masked (slots precomputed, gathered per
   query as `adapters.paged` did before `PoolRows`; the prefill in chunks of 64 queries, whose
   gathered keys and ``(64, H, G)`` products fit). TB/s counts the key bytes read
   (``B * G * d * bytes``) against 4.22 TB/s (the measured device-to-device copy).
3. A small sweep of launch configurations (``--no-sweep`` skips it; so does the budget).

Results go to stdout and, with ``--json``, to a file that records the commit, the command,
the machine and the date (`bench.meta.run_meta`); the file is rewritten after every section.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if "--smoke" in sys.argv:  # before Triton is imported and the kernels are decorated
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from bench.meta import run_meta  # noqa: E402

PEAK_TBPS = 4.22  # device-to-device copy measured on the lent H200 (KERNELS.md)
SEED = 1234
FP8 = torch.float8_e4m3fn


class Run:
    def __init__(self, args) -> None:
        self.args = args
        self.smoke = args.smoke
        self.dev = torch.device("cpu" if args.smoke else "cuda")
        self.start = time.monotonic()
        self.meta = run_meta()
        self.checks: list[dict] = []
        self.rows: list[dict] = []
        self.sweep: list[dict] = []
        from adapters import ops
        from adapters.kernels import indexer, indexer_reference
        from adapters.kernels.rows import PoolRows

        self.ops, self.ix, self.ref, self.PoolRows = ops, indexer, indexer_reference, PoolRows
        self.heads, self.dim = (4, 32) if self.smoke else (64, 128)

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {msg}", flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def save(self) -> None:
        if self.args.json:
            self.meta["seconds"] = round(self.elapsed(), 1)
            data = dict(meta=self.meta, checks=self.checks, rows=self.rows, sweep=self.sweep)
            self.args.json.parent.mkdir(parents=True, exist_ok=True)
            self.args.json.write_text(json.dumps(data, indent=1))

    # -- inputs
    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.dev).manual_seed(seed)

    def decode_case(self, b, g_rows, kdt, seed, spp=16, qdt=torch.bfloat16, lengths=None):
        """``b`` requests, each ``g_rows`` rows on its own random pages of one pool."""
        gen, d, h = self.gen(seed), self.dim, self.heads
        pages = g_rows // spp
        pool_rows = b * g_rows
        perm = torch.randperm(pool_rows // spp, generator=gen, device=self.dev)
        table = perm[: b * pages].view(b, pages)
        if lengths is None:
            lengths = torch.full((b,), g_rows, device=self.dev)
        rows = self.PoolRows(table, lengths, None, spp)
        return self._tensors(gen, b, h, d, pool_rows, kdt, qdt) + (rows,)

    def prefill_case(self, n, g_rows, kdt, seed, qdt=torch.bfloat16, spp=16, qrow=None):
        """``n`` queries at the last positions of a ``4 * g_rows``-token context reading one
        request's ``g_rows`` entries: lengths ``(pos + 1) // 4``."""
        gen, d, h = self.gen(seed), self.dim, self.heads
        pages = g_rows // spp
        table = torch.randperm(2 * pages, generator=gen, device=self.dev)[:pages].view(1, pages)
        pos = torch.arange(4 * g_rows - n, 4 * g_rows, device=self.dev)
        if qrow is None:
            qrow = torch.zeros(n, dtype=torch.long, device=self.dev)
        else:  # a second request's rows: another table row
            table = torch.cat((table, table.roll(1, 1)), 0)
        rows = self.PoolRows(table, (pos + 1) // 4, qrow, spp)
        return self._tensors(gen, n, h, d, 2 * g_rows, kdt, qdt) + (rows,)

    def _tensors(self, gen, n, h, d, pool_rows, kdt, qdt):
        dev = self.dev
        q = (torch.randn(n, h, d, generator=gen, device=dev) * 0.5).to(qdt)
        w = torch.randn(n, h, generator=gen, device=dev).to(qdt)
        keys = torch.randn(pool_rows, d, generator=gen, device=dev)
        scale = None
        if kdt == FP8:
            scale = torch.rand(pool_rows, generator=gen, device=dev) * 0.1 + 0.02
            keys = (keys / scale[:, None]).clamp(-448, 448)
        return q, w, keys.to(kdt), scale

    # -- the paths
    def kernel(self, q, w, keys, scale, rows, out=None, **knobs):
        return self.ix.flash_index_logits(q, w, keys, rows, key_scale=scale, out=out, **knobs)

    def old_path(self, q, w, keys, rows, chunk):
        """``ops.index_scores`` over gathered keys, masked; slots and masks precomputed."""
        parts = []
        for a in range(0, rows.num_queries, chunk):
            part = rows.select(slice(a, a + chunk))
            parts.append((a, part.slots(), ~part.mask()))
        out = torch.empty(rows.num_queries, rows.num_rows, device=self.dev)

        def run():
            for a, slots, hidden in parts:
                s = self.ops.index_scores(q[a : a + chunk], w[a : a + chunk], keys[slots])
                out[a : a + chunk] = s.masked_fill(hidden, float("-inf"))
            return out

        return run

    # -- checks
    def compare(self, case: str, got: torch.Tensor, want: torch.Tensor) -> dict:
        want = want.float()
        same_inf = bool(torch.equal(torch.isinf(got), torch.isinf(want)))
        fin = torch.isfinite(want)
        diff = (got[fin] - want[fin]).abs()
        scale = want[fin].abs().max().clamp_min(1e-30) if fin.any() else torch.tensor(1.0)
        rel = float(diff.norm() / want[fin].norm().clamp_min(1e-30)) if fin.any() else 0.0
        mx = float(diff.max() / scale) if fin.any() else 0.0
        ok = same_inf and math.isfinite(rel) and rel < 1e-5 and not bool(got.isnan().any())
        row = dict(case=case, ok=ok, rel_l2=rel, max_err_over_max=mx, same_inf=same_inf)
        self.checks.append(row)
        self.log(f"check {case}: {'ok' if ok else 'FAIL'} rel {rel:.2e} max {mx:.2e}")
        return row

    def check(self, case, q, w, keys, scale, rows, **knobs) -> torch.Tensor | None:
        try:
            want = self.ref.index_logits_reference(q, w, keys, rows, key_scale=scale)
            self.compare(case, self.kernel(q, w, keys, scale, rows, **knobs), want)
            return want
        except Exception as exc:  # noqa: BLE001 - report and carry on
            self.checks.append(dict(case=case, ok=False, error=_short(exc)))
            self.log(f"check {case}: ERROR {_short(exc)}")
            traceback.print_exc()
            return None

    # -- timing
    def eager_us(self, fn, reps: int = 20) -> float:
        fn()
        if self.dev.type != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        return statistics.median(times)

    def graph_us(self, fns, calls: int, replays: int = 10) -> float | None:
        """Per-call time of ``calls`` back-to-back calls cycling through ``fns``, captured."""
        if self.dev.type != "cuda":
            return None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[i % len(fns)]()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / calls)
        del graph
        return statistics.median(times)

    def timed(self, name, shape, fns, calls, key_bytes=None, flops=None, reps=20) -> dict:
        row = dict(name=name, shape=shape, eager_us=None, graph_us=None)
        try:
            row["eager_us"] = self.eager_us(fns[0], reps)
            row["graph_us"] = self.graph_us(fns, calls)
        except Exception as exc:  # noqa: BLE001
            row["error"] = _short(exc)
            traceback.print_exc()
            if self.dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        for kind in ("eager", "graph"):
            us = row.get(f"{kind}_us")
            if us and key_bytes:
                row[f"{kind}_tbps"] = key_bytes / (us * 1e-6) / 1e12
                row[f"{kind}_peak_frac"] = row[f"{kind}_tbps"] / PEAK_TBPS
            if us and flops:
                row[f"{kind}_tflops"] = flops / (us * 1e-6) / 1e12
        self.rows.append(row)
        self.log(
            f"{name:34} {shape:28} eager {_fmt(row['eager_us'])} us  graph "
            f"{_fmt(row['graph_us'])} us"
            + (f"  ({_fmt(row.get('graph_tbps'), 2)} TB/s)" if row.get("graph_tbps") else "")
            + (f"  ({_fmt(row.get('eager_tflops'))} TFLOP/s)" if row.get("eager_tflops") else "")
            + (f"  ERROR {row['error']}" if row.get("error") else "")
        )
        return row


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:200]


def _fmt(x, nd=1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def checks(run: Run) -> None:
    small = run.smoke
    gd = 256 if small else 65536
    bf, f32, f16 = torch.bfloat16, torch.float32, torch.float16
    b = 3
    lengths = torch.tensor([0, gd // 3 + 5, gd], device=run.dev)
    for kdt in (bf, FP8):
        tag = "bf16" if kdt == bf else "fp8"
        run.check(
            f"decode {tag} B3 G{gd} spp16 lengths 0/partial/full",
            *run.decode_case(b, gd, kdt, 1, lengths=lengths),
        )
    run.check(f"decode bf16 B3 G{gd} slot table", *run.decode_case(b, gd, bf, 2, spp=1))
    n, gp = (8, 256) if small else (512, 8192)
    for kdt in (bf, FP8):
        tag = "bf16" if kdt == bf else "fp8"
        run.check(f"prefill {tag} N{n} G{gp} shared causal", *run.prefill_case(n, gp, kdt, 3))
    qrow = torch.zeros(n, dtype=torch.long, device=run.dev)
    qrow[n // 2 + 1 :] = 1  # a block of four straddles the two row sets
    run.check(f"prefill bf16 N{n} G{gp} two row sets", *run.prefill_case(n, gp, bf, 4, qrow=qrow))
    gm = 256 if small else 8192
    for qdt, kdt in [(f32, bf), (f32, FP8), (f32, f32), (f16, f16), (bf, f16), (f16, bf)]:
        tag = f"q {str(qdt)[6:]} keys {str(kdt)[6:]}"
        run.check(f"decode {tag} B3 G{gm}", *run.decode_case(b, gm, kdt, 5, qdt=qdt))
        if qdt == f32:
            run.check(f"prefill {tag} N{n // 2} G{gm}", *run.prefill_case(n // 2, gm, kdt, 6, qdt))
    run.save()


def decode(run: Run, b: int, kdt, sweep: bool) -> None:
    g_rows = 512 if run.smoke else 262144
    tag = "bf16" if kdt == torch.bfloat16 else "fp8"
    shape = f"B{b} G{g_rows} {tag} spp16"
    sets = [run.decode_case(b, g_rows, kdt, 10 + b + i) for i in range(2 if b == 1 else 1)]
    q, w, keys, scale, rows = sets[0]
    key_bytes = b * g_rows * run.dim * keys.element_size()
    outs = [torch.empty(b, g_rows, device=run.dev) for _ in sets]
    want = run.check(f"decode {shape} (timed shape)", *sets[0])

    def fns(**knobs):
        return [(lambda s=s, o=o: run.kernel(*s, out=o, **knobs)) for s, o in zip(sets, outs)]

    calls = 20 if b == 1 else 5
    if not sweep:
        run.timed(f"kernel decode {tag}", shape, fns(), calls, key_bytes)
        if kdt == torch.bfloat16:
            old = [run.old_path(s[0], s[1], s[2], s[4], b) for s in sets]
            run.timed(f"old einsum path decode {tag}", shape, old, calls, key_bytes)
        run.save()
        return
    for knobs in SWEEP_DECODE[tag]:
        label = ",".join(f"{k}={v}" for k, v in knobs.items())
        row = dict(shape=shape, knobs=label)
        try:
            got = run.kernel(q, w, keys, scale, rows, **knobs)
            if want is not None:
                row["check"] = run.compare(f"sweep {shape} {label}", got, want)["ok"]
            r = run.timed(f"sweep decode {tag} {label}", shape, fns(**knobs), calls, key_bytes)
            row.update(graph_us=r["graph_us"], graph_tbps=r.get("graph_tbps"))
        except Exception as exc:  # noqa: BLE001
            row["error"] = _short(exc)
            run.log(f"sweep {shape} {label}: ERROR {row['error']}")
        run.sweep.append(row)
    run.save()


def prefill(run: Run, kdt, sweep: bool) -> None:
    n, g_rows = (16, 512) if run.smoke else (2048, 32768)
    tag = "bf16" if kdt == torch.bfloat16 else "fp8"
    shape = f"N{n} G{g_rows} {tag} shared causal"
    case = run.prefill_case(n, g_rows, kdt, 20)
    q, w, keys, scale, rows = case
    flops = 2 * run.heads * run.dim * float(rows.lengths.clamp(max=g_rows).sum())
    out = torch.empty(n, g_rows, device=run.dev)
    want = run.check(f"prefill {shape} (timed shape)", *case)
    if not sweep:
        run.timed(f"kernel prefill {tag}", shape, [lambda: run.kernel(*case, out=out)], 5, None,
                  flops, reps=10)  # fmt: skip
        if kdt == torch.bfloat16:
            old = run.old_path(q, w, keys, rows, 64)
            run.timed(f"old einsum path prefill {tag}", shape, [old], 2, None, flops, reps=3)
        run.save()
        return
    for knobs in SWEEP_PREFILL:
        label = ",".join(f"{k}={v}" for k, v in knobs.items())
        row = dict(shape=shape, knobs=label)
        try:
            got = run.kernel(*case, **knobs)
            if want is not None:
                row["check"] = run.compare(f"sweep {shape} {label}", got, want)["ok"]
            r = run.timed(f"sweep prefill {tag} {label}", shape,
                          [lambda knobs=knobs: run.kernel(*case, out=out, **knobs)], 5, None,
                          flops, reps=10)  # fmt: skip
            row.update(eager_us=r["eager_us"], graph_us=r["graph_us"])
        except Exception as exc:  # noqa: BLE001
            row["error"] = _short(exc)
            run.log(f"sweep {shape} {label}: ERROR {row['error']}")
        run.sweep.append(row)
    run.save()


SWEEP_DECODE = {
    "bf16": [
        dict(block_e=64, num_warps=4, per_sm=4),
        dict(block_e=128, num_warps=8),
        dict(block_e=256, num_warps=8, per_sm=1),
        dict(block_e=128, num_warps=4, per_sm=4),
    ],
    "fp8": [dict(block_e=256, num_warps=8), dict(block_e=128, num_warps=4)],
}
SWEEP_PREFILL = [
    dict(block_q=2, block_e=128, num_warps=8),
    dict(block_q=4, block_e=128, num_warps=8),
    dict(block_q=2, block_e=64, num_warps=4),
    dict(block_q=8, block_e=64, num_warps=8),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, help="write every check and row to this file")
    p.add_argument("--budget", type=float, default=150.0, help="seconds before the sweep stops")
    p.add_argument("--no-sweep", action="store_true", help="skip the launch-parameter sweep")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or use --smoke to exercise the script on the CPU")
        return 2
    torch.manual_seed(SEED)
    run = Run(args)
    run.log(f"setup: {run.meta}")
    bf = torch.bfloat16
    parts = [
        ("checks", lambda: checks(run)),
        ("decode B1 bf16", lambda: decode(run, 1, bf, False)),
        ("decode B32 bf16", lambda: decode(run, 32, bf, False)),
        ("prefill bf16", lambda: prefill(run, bf, False)),
        ("decode B1 fp8", lambda: decode(run, 1, FP8, False)),
        ("decode B32 fp8", lambda: decode(run, 32, FP8, False)),
        ("prefill fp8", lambda: prefill(run, FP8, False)),
    ]
    if not args.no_sweep:
        parts += [
            ("sweep decode B1 bf16", lambda: decode(run, 1, bf, True)),
            ("sweep decode B32 bf16", lambda: decode(run, 32, bf, True)),
            ("sweep prefill bf16", lambda: prefill(run, bf, True)),
            ("sweep decode B32 fp8", lambda: decode(run, 32, FP8, True)),
        ]
    for name, part in parts:
        if name.startswith("sweep") and run.elapsed() > args.budget:
            run.log(f"{name}: skipped (time budget)")
            run.sweep.append(dict(part=name, skipped="time budget"))
            continue
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - a broken part must not hide the others
            run.rows.append(dict(name=name, error=_short(exc)))
            run.log(f"{name}: ERROR {_short(exc)}")
            traceback.print_exc()
        if run.dev.type == "cuda":
            torch.cuda.empty_cache()
    run.save()
    bad = [c for c in run.checks if not c.get("ok")]
    run.log(
        f"{len(run.checks) - len(bad)}/{len(run.checks)} checks ok; total {run.elapsed():.1f} s"
    )
    print(json.dumps(dict(meta=run.meta, rows=run.rows, sweep=run.sweep), indent=1))
    if args.json:
        print(f"wrote {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
