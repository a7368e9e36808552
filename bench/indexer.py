"""The fused Lightning indexer (`adapters.kernels.indexer.flash_index_logits`) on one GPU
(made for an H200), against the reference and against the old einsum path.

    python bench/indexer.py [--json PATH] [--budget SECONDS] [--no-sweep]
    python bench/indexer.py --fp8-candidates [--json PATH]   # only section 4
    python bench/indexer.py --smoke [--fp8-candidates]       # CPU, Triton interpreter, tiny shapes

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
   query as `adapters.forward.paged` did before `PoolRows`; the prefill in chunks of 64 queries,
   whose
   gathered keys and ``(64, H, G)`` products fit). TB/s counts the key bytes read
   (``B * G * d * bytes``; FP4: ``d / 2`` bytes and its block scales) against 4.22 TB/s (the
   measured device-to-device copy). FP4 keys (V4.1, `formats.quantize`) are checked and timed
   beside bf16 and FP8 for decode B = 32 and the prefill (parts ``decode B32 fp4``,
   ``prefill fp4``: a failure there is reported and the run goes on).
3. A small sweep of launch configurations (``--no-sweep`` skips it; so does the budget), FP4
   decode B = 32 among them (its defaults, `FP4_LAUNCH`, are unmeasured).
4. Only with ``--fp8-candidates``, instead of 1-3 (about two minutes): the FP8 key paths,
   every `Fp8Mode` with a few launches each (`FP8_CANDIDATES`), beside bf16 keys, for decode B = 1
   and B = 32 over G = 262,144 and the prefill N = 2048 over G = 32,768. Each candidate is
   checked against the reference on the timed inputs and on two odd ones (decode lengths
   0 / partial / full; prefill blocks straddling two row sets): exact modes within 1e-5
   relative L2, ``FP8_DOT`` (approximate by design) within 1e-3, its error recorded. Then
   timed eager and in a CUDA graph (at B = 1 the calls cycle through four pools, 32 MiB of
   FP8 keys each, so that L2 holds none of the next). A candidate that fails to compile or
   run is reported and the others go on. The table at the end ranks them per shape and
   prints the lines of `adapters/kernels/indexer.py` that make the fastest exact one the
   default (the FP8 rows of the JSON: ``fp8_candidates``; the pick: ``meta.fp8_best_*``).

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
FP4 = torch.uint8  # V4.1 FP4 keys: e2m1 codes two a byte, one fp32 scale per 32 channels
KEY_TAGS = {torch.bfloat16: "bf16", FP8: "fp8", FP4: "fp4"}


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
        self.fp8: list[dict] = []
        from adapters.kernels import indexer, indexer_reference
        from adapters.kernels.rows import PoolRows
        from adapters.model import ops

        self.ops, self.ix, self.ref, self.PoolRows = ops, indexer, indexer_reference, PoolRows
        self.heads, self.dim = (4, 32) if self.smoke else (64, 128)

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {msg}", flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def save(self) -> None:
        if self.args.json:
            self.meta["seconds"] = round(self.elapsed(), 1)
            data = dict(meta=self.meta, checks=self.checks, rows=self.rows, sweep=self.sweep,
                        fp8_candidates=self.fp8)  # fmt: skip
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
        if kdt == FP4:  # `formats.quantize`: the bytes and block scales the cache stores
            from adapters.memory.formats import CacheFormat, quantize

            fp4 = quantize(keys, CacheFormat.FP4)
            return q, w, fp4.values, fp4.scales
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
    def compare(self, case: str, got: torch.Tensor, want: torch.Tensor, tol=1e-5) -> dict:
        want = want.float()
        same_inf = bool(torch.equal(torch.isinf(got), torch.isinf(want)))
        fin = torch.isfinite(want)
        diff = (got[fin] - want[fin]).abs()
        scale = want[fin].abs().max().clamp_min(1e-30) if fin.any() else torch.tensor(1.0)
        rel = float(diff.norm() / want[fin].norm().clamp_min(1e-30)) if fin.any() else 0.0
        mx = float(diff.max() / scale) if fin.any() else 0.0
        ok = same_inf and math.isfinite(rel) and rel < tol and not bool(got.isnan().any())
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

    def timed(self, name, shape, fns, calls, key_bytes=None, flops=None, reps=20,
              into=None) -> dict:  # fmt: skip
        """Eager and graph times of ``fns`` (a row, appended to ``into``, else `rows`)."""
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
        (self.rows if into is None else into).append(row)
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
    tag = KEY_TAGS[kdt]
    shape = f"B{b} G{g_rows} {tag} spp16"
    sets = [run.decode_case(b, g_rows, kdt, 10 + b + i) for i in range(2 if b == 1 else 1)]
    q, w, keys, scale, rows = sets[0]
    key_bytes = b * g_rows * keys.shape[1] * keys.element_size()
    if kdt == FP4:  # its block scales are read too (FP8's row scale: not counted)
        key_bytes += b * g_rows * scale.shape[1] * scale.element_size()
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


def shared_decode(run: Run, b: int, kdt) -> None:
    """``b`` requests over one document: their tables are one table but for the last page (a
    distinct tail each), timed with the shared-prefix split on and off, side by side."""
    g_rows = 512 if run.smoke else 262144
    tag = KEY_TAGS[kdt]
    shape = f"B{b} G{g_rows} {tag} spp16 shared prefix"
    q, w, keys, scale, rows = run.decode_case(b, g_rows, kdt, 40 + b)
    table = rows.table.clone()
    table[:, :-1] = table[0, :-1]  # the last page of each row stays its own
    rows = run.PoolRows(table, rows.lengths, None, rows.slots_per_page)
    key_bytes = b * g_rows * keys.shape[1] * keys.element_size()
    for split in (True, False):
        run.check(f"decode {shape} split={split}", q, w, keys, scale, rows, shared_prefix=split)
        out = torch.empty(b, g_rows, device=run.dev)
        fn = [lambda o=out, s=split: run.kernel(q, w, keys, scale, rows, out=o, shared_prefix=s)]
        run.timed(f"kernel decode {tag} shared prefix, split={split}", shape, fn, 5, key_bytes)
    if kdt == FP8:  # the FP8 indexer as the runner calls it: q rounded to e4m3 (FP8_Q)
        q8 = dict(fp8_mode=run.ix.Fp8Mode.FP8_Q)
        want = _reference(run, (q, w, keys, scale, rows), fp8_q=True)
        for split in (True, False):
            got = run.kernel(q, w, keys, scale, rows, shared_prefix=split, **q8)
            run.compare(f"decode {shape} FP8_Q split={split}", got, want, 1e-3)
            out = torch.empty(b, g_rows, device=run.dev)
            fn = [lambda o=out, s=split: run.kernel(q, w, keys, scale, rows, out=o,
                                                    shared_prefix=s, **q8)]  # fmt: skip
            run.timed(f"kernel decode fp8 q+keys shared prefix, split={split}", shape, fn, 5,
                      key_bytes)  # fmt: skip
    run.save()


def prefill(run: Run, kdt, sweep: bool) -> None:
    n, g_rows = (16, 512) if run.smoke else (2048, 32768)
    tag = KEY_TAGS[kdt]
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


# Section 4: the FP8 key paths (`Fp8Mode`), each at its defaults and a few other launches
# (knobs of `launch_config`; the first of each mode is its defaults). Registers and shared
# memory per program (Triton 3.6, sm_90a, compiled without a GPU) are noted where they set
# the programs per SM: 65,536 registers and 227 KB of shared memory per SM.
FP8_CANDIDATES = {
    "decode": [
        ("DOT_A", {}),  # the FP8 default until now: 113 regs x 8 warps, 2 programs per SM
        ("DOT_A", dict(num_stages=5, maxnreg=80, per_sm=3)),  # 2 buffers, 3 per SM
        ("KEYS_B", {}),  # 129 regs x 4 warps, 66 KB: 3 per SM
        ("KEYS_B", dict(num_warps=8, num_stages=5, maxnreg=80, per_sm=2)),
        ("STAGED", {}),  # 128 regs x 8 warps: 2 per SM
        ("STAGED", dict(maxnreg=80, per_sm=3)),
        ("STAGED", dict(block_e=64, num_warps=4, per_sm=4)),  # 108 regs x 4 warps, 33 KB
        ("STAGED_F16", dict(maxnreg=80, per_sm=3)),
        ("FP8_DOT", {}),  # 98 regs x 8 warps, 2 buffers
        ("FP8_DOT", dict(num_stages=5)),  # 3 buffers
        ("FP8_DOT", dict(block_e=64, num_warps=4, num_stages=5, per_sm=4)),  # 102 regs, 42 KB
        ("FP8_Q", {}),  # q rounded to e4m3: another function, checked against its reference
        ("FP8_Q", dict(block_e=64, num_warps=4, per_sm=4)),
    ],
    "prefill": [
        ("DOT_A", {}),  # the FP8 default until now: 171 regs x 8 warps, 1 program per SM
        ("DOT_A", dict(maxnreg=128)),  # 2 per SM, as bf16 keys (127 regs)
        ("KEYS_B", {}),  # maxnreg 128
        ("STAGED", {}),  # 128 regs (maxnreg 128), 82 KB: 2 per SM
        ("STAGED", dict(block_q=2, num_warps=4, per_sm=4)),
        ("STAGED_F16", {}),  # maxnreg 128
        ("FP8_DOT", {}),  # 2 queries x 64 rows (N = 256 with the two parts), maxnreg 128
        ("FP8_DOT", dict(block_q=4, maxnreg=168, per_sm=1)),  # N = 512
        ("FP8_Q", {}),  # 4 queries x 64 rows (N = 256), as bf16 keys
        ("FP8_Q", dict(block_q=2, num_warps=4, per_sm=4)),
    ],
}
# relative L2 accepted for Hopper's FP8 accumulation (FP8_Q against the reference's fp8_q);
# every other mode: 1e-5
FP8_TOLERANCE = {"FP8_DOT": 1e-3, "FP8_Q": 1e-3}

SWEEP_DECODE = {
    "bf16": [
        dict(block_e=64, num_warps=4, per_sm=4),
        dict(block_e=128, num_warps=8),
        dict(block_e=256, num_warps=8, per_sm=1),
        dict(block_e=128, num_warps=4, per_sm=4),
    ],
    "fp8": [dict(block_e=256, num_warps=8), dict(block_e=128, num_warps=4)],
    "fp4": [  # FP4_LAUNCH's decode default (64 x 4 warps, 3 per SM) is a guess from registers
        dict(block_e=64, num_warps=4, per_sm=4),
        dict(block_e=64, num_warps=8, per_sm=1),
        dict(block_e=128, num_warps=8, per_sm=1),
        dict(block_e=128, num_warps=8, per_sm=2, maxnreg=128),
    ],
}
SWEEP_PREFILL = [
    dict(block_q=2, block_e=128, num_warps=8),
    dict(block_q=4, block_e=128, num_warps=8),
    dict(block_q=2, block_e=64, num_warps=4),
    dict(block_q=8, block_e=64, num_warps=8),
]


class Fp8Shape:
    """One timed shape of section 4: bf16 and FP8 inputs and their references, the odd FP8
    case of the kind, and how to time a path on it."""

    def __init__(self, run: Run, kind: str, b: int) -> None:
        self.run, self.kind = run, kind
        small = run.smoke
        if kind == "decode":
            g = 512 if small else 262144
            self.name = f"decode B{b} G{g}"
            sets = 4 if b == 1 else 1  # B = 1 cycles through 4 pools: L2 (50 MB) holds none
            self.cases = {k: [run.decode_case(b, g, k, 30 + b + i) for i in range(sets)]
                          for k in (torch.bfloat16, FP8)}  # fmt: skip
            self.calls, self.reps, self.flops = (20 if b == 1 else 5), 20, None
            gd = 256 if small else 65536
            lengths = torch.tensor([0, gd // 3 + 5, gd], device=run.dev)
            odd = run.decode_case(3, gd, FP8, 38, lengths=lengths)
            self.odd_name = f"B3 G{gd} lengths 0/partial/full"
        else:
            n, g = (16, 512) if small else (2048, 32768)
            self.name = f"prefill N{n} G{g}"
            self.cases = {k: [run.prefill_case(n, g, k, 40)] for k in (torch.bfloat16, FP8)}
            self.calls, self.reps = 5, 10
            rows = self.cases[FP8][0][4]
            self.flops = 2 * run.heads * run.dim * float(rows.lengths.clamp(max=g).sum())
            n2, g2 = (8, 256) if small else (512, 8192)
            qrow = torch.zeros(n2, dtype=torch.long, device=run.dev)
            qrow[n2 // 2 + 1 :] = 1  # a block of four straddles the two row sets
            odd = run.prefill_case(n2, g2, FP8, 41, qrow=qrow)
            self.odd_name = f"N{n2} G{g2} two row sets"
        self.odd = odd
        self.odd_want = _reference(run, odd)
        self.want = {k: _reference(run, sets[0]) for k, sets in self.cases.items()}
        # FP8_Q is another function (q rounded to e4m3): its own references
        self.want_q8 = _reference(run, self.cases[FP8][0], fp8_q=True)
        self.odd_want_q8 = _reference(run, odd, fp8_q=True)
        self.outs = [torch.empty(r.num_queries, r.num_rows, device=run.dev)
                     for *_, r in self.cases[FP8]]  # fmt: skip

    def key_bytes(self, kdt) -> int | None:
        if self.kind != "decode":
            return None
        _, _, keys, _, rows = self.cases[kdt][0]
        return rows.num_queries * rows.num_rows * self.run.dim * keys.element_size()

    def fns(self, kdt, knobs):
        run = self.run
        return [(lambda s=s, o=o: run.kernel(*s, out=o, **knobs))
                for s, o in zip(self.cases[kdt], self.outs)]  # fmt: skip


def _reference(run: Run, case, fp8_q: bool = False) -> torch.Tensor:
    q, w, keys, scale, rows = case
    return run.ref.index_logits_reference(q, w, keys, rows, key_scale=scale, fp8_q=fp8_q)


def _compiled(run: Run) -> dict:
    """Triton's compiled indexer kernels by cache key (a private API of Triton 3.x: empty
    when it differs, or under the interpreter)."""
    try:
        caches = run.ix._index_kernel.device_caches.values()
        return {key: k for cache in caches for key, k in cache[0].items()}
    except Exception:  # noqa: BLE001
        return {}


def _kernel_facts(kernels) -> list[dict]:
    facts = []
    for k in kernels:
        try:
            facts.append(dict(n_regs=k.n_regs, n_spills=k.n_spills, shared=k.metadata.shared,
                              num_warps=k.metadata.num_warps))  # fmt: skip
        except Exception:  # noqa: BLE001 - best effort
            pass
    return facts


def fp8_path(run: Run, sh: Fp8Shape, kdt, mode: str | None, knobs: dict, odd: bool) -> dict:
    """Checks (``odd``: also on the kind's odd case) and times one path on one shape; its
    errors are recorded, never raised. The registers, spills and shared memory of a path's
    kernels are recorded where it compiles them (its first shape)."""
    tag = "bf16 keys" if kdt == torch.bfloat16 else f"fp8 {mode}"
    label = tag + (" " + ",".join(f"{k}={v}" for k, v in knobs.items()) if knobs else "")
    row = dict(kind=sh.kind, shape=sh.name, path=label, mode=mode, knobs=dict(knobs))
    full = dict(knobs, fp8_mode=run.ix.Fp8Mode[mode]) if mode else dict(knobs)
    tol = FP8_TOLERANCE.get(mode or "", 1e-5)
    before = set(_compiled(run))
    try:
        if mode:
            dft = run.ix.ONE_DOT_LAUNCH[(sh.kind == "prefill", run.ix.Fp8Mode[mode])]
            row["launch"] = dft._replace(**knobs)._asdict()
        q8 = mode == "FP8_Q"
        got = run.kernel(*sh.cases[kdt][0], **full)
        chk = run.compare(f"{sh.name} {label}", got, sh.want_q8 if q8 else sh.want[kdt], tol)
        row.update(ok=chk["ok"], rel_l2=chk["rel_l2"], max_err_over_max=chk["max_err_over_max"])
        del got
        if odd:  # the mode alone: no shared-prefix split (its shared half is a prefill tile)
            got = run.kernel(
                *sh.odd, **full, **({"shared_prefix": False} if sh.kind == "decode" else {})
            )
            odd_want = sh.odd_want_q8 if q8 else sh.odd_want
            chk = run.compare(f"{sh.name} {label} / {sh.odd_name}", got, odd_want, tol)
            row.update(odd_ok=chk["ok"], odd_rel_l2=chk["rel_l2"])
            del got
        t = run.timed(label, sh.name, sh.fns(kdt, full), sh.calls, sh.key_bytes(kdt), sh.flops,
                      sh.reps, into=[])  # fmt: skip
        row.update({k: v for k, v in t.items() if k not in ("name", "shape")})
    except Exception as exc:  # noqa: BLE001 - one failing candidate must not stop the others
        row["error"] = _short(exc)
        run.log(f"{sh.name} {label}: ERROR {row['error']}")
        traceback.print_exc()
        if run.dev.type == "cuda":
            torch.cuda.synchronize()
    new = [k for key, k in _compiled(run).items() if key not in before]
    if new:
        row["kernels"] = _kernel_facts(new)
    run.fp8.append(row)
    run.save()
    return row


def fp8_candidates(run: Run) -> None:
    """Section 4 (the module docstring): every candidate on every shape, then the table."""
    for kind, b in (("decode", 1), ("decode", 32), ("prefill", 0)):
        try:
            sh = Fp8Shape(run, kind, b)
        except Exception as exc:  # noqa: BLE001
            run.fp8.append(dict(kind=kind, b=b, error=_short(exc)))
            run.log(f"fp8 {kind} B{b}: ERROR {_short(exc)}")
            traceback.print_exc()
            continue
        first = b != 32  # decode B32 runs B1's kernels: the odd case once per kind
        fp8_path(run, sh, torch.bfloat16, None, {}, False)
        for mode, knobs in FP8_CANDIDATES[kind]:
            fp8_path(run, sh, FP8, mode, knobs, first)
        del sh
        if run.dev.type == "cuda":
            torch.cuda.empty_cache()
    fp8_table(run)


def _ok(row: dict) -> bool:
    return bool(row.get("ok")) and row.get("odd_ok", True) is not False and not row.get("error")


def fp8_table(run: Run) -> None:
    """Per shape, every path by graph time (eager without graphs), against bf16 keys and the
    FP8 default until now (DOT_A at its defaults); then the default each kind would take."""
    print("\nFP8 key paths: us per call; x bf16, x DOT_A: their time over this path's (> 1 is "
          "faster); rel L2 error against the reference")  # fmt: skip
    print(f"{'shape':22} {'path':58} {'graph':>9} {'eager':>9} {'TB/s':>5} {'TFLOP/s':>7} "
          f"{'x bf16':>6} {'x DOT_A':>7} {'rel L2':>8} {'regs':>4}  check")  # fmt: skip
    regs = {r["path"]: r["kernels"][0].get("n_regs") for r in run.fp8 if r.get("kernels")}
    for shape in dict.fromkeys(r["shape"] for r in run.fp8 if "shape" in r):
        rows = [r for r in run.fp8 if r.get("shape") == shape]
        times = {r["path"]: _time(r) for r in rows}
        for r in sorted(rows, key=lambda r: _time(r) or math.inf):
            print(_table_line(r, times.get("bf16 keys"), times.get("fp8 DOT_A"), regs))
    for kind in ("decode", "prefill"):
        _suggest(run, kind)


def _table_line(r: dict, bf: float | None, dot_a: float | None, regs: dict) -> str:
    t = _time(r)
    if r.get("error"):
        check = "ERROR " + r["error"][:70]
    else:
        check = "FAIL" if not _ok(r) else "approx" if r.get("mode") in FP8_TOLERANCE else "ok"
    tbps = r.get("graph_tbps") or r.get("eager_tbps")
    tflops = r.get("graph_tflops") or r.get("eager_tflops")
    return (
        f"{r['shape']:22} {r['path']:58} {_fmt(r.get('graph_us')):>9} "
        f"{_fmt(r.get('eager_us')):>9} {_fmt(tbps, 2):>5} {_fmt(tflops, 0):>7} "
        f"{_ratio(bf, t):>6} {_ratio(dot_a, t):>7} {_fmt_e(r.get('rel_l2')):>8} "
        f"{regs.get(r['path'], '-'):>4}  {check}"
    )


def _suggest(run: Run, kind: str) -> None:
    """Prints (and records in the meta) the fastest exact path of ``kind`` and the lines of
    `adapters.kernels.indexer` that make it the default."""
    best, approx = _best(run, kind, exact=True), _best(run, kind, exact=False)
    if best is None:
        print(f"{kind}: no FP8 candidate passed its checks on every {kind} shape")
        return
    name = "FP8_DECODE_MODE" if kind == "decode" else "FP8_PREFILL_MODE"
    la = best["launch"]
    extra = f", {la['maxnreg']}" if la.get("maxnreg") else ""
    line = (
        f"({kind == 'prefill'}, Fp8Mode.{best['mode']}): Launch({la['block_q']}, "
        f"{la['block_e']}, {la['num_warps']}, {la['per_sm']}, {la['num_stages']}{extra}),"
    )
    print(f"{kind}: fastest exact path {best['path']!r}: {best['score']:.2f} x bf16 keys' time "
          f"(geometric mean over the {kind} shapes). To make it the default, in "
          f"adapters/kernels/indexer_plan.py: {name} = Fp8Mode.{best['mode']}, and in "
          f"ONE_DOT_LAUNCH the line\n    {line}")  # fmt: skip
    if approx is not None and approx["path"] != best["path"]:
        print(
            f"{kind}: fastest within 1e-3 (approximate): {approx['path']!r}: "
            f"{approx['score']:.2f} x bf16 keys' time, rel L2 up to {approx['worst_rel']:.1e}"
        )
    run.meta[f"fp8_best_{kind}"] = dict(path=best["path"], score=best["score"], line=line)
    run.save()


def _best(run: Run, kind: str, exact: bool) -> dict | None:
    """The FP8 candidate whose time relative to bf16 keys' (geometric mean over the kind's
    shapes) is least among those that passed every check (``exact``: not FP8_DOT)."""
    mine = [r for r in run.fp8 if r.get("kind") == kind and "shape" in r]
    shapes = list(dict.fromkeys(r["shape"] for r in mine))
    bf = {r["shape"]: _time(r) for r in mine if r["path"] == "bf16 keys"}
    best = None
    for path in dict.fromkeys(r["path"] for r in mine if r.get("mode")):
        rows = [r for r in mine if r["path"] == path]
        if exact and rows[0]["mode"] in FP8_TOLERANCE:
            continue
        good = [r for r in rows if _ok(r) and _time(r) and bf.get(r["shape"])]
        if len(good) != len(shapes):
            continue
        score = math.exp(statistics.mean(math.log(_time(r) / bf[r["shape"]]) for r in good))
        if best is None or score < best["score"]:
            best = dict(rows[0], score=score, worst_rel=max(r.get("rel_l2") or 0.0 for r in good))
    return best


def _time(row: dict) -> float | None:
    return row.get("graph_us") or row.get("eager_us")


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def _fmt_e(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, help="write every check and row to this file")
    p.add_argument("--budget", type=float, default=150.0, help="seconds before the sweep stops")
    p.add_argument("--no-sweep", action="store_true", help="skip the launch-parameter sweep")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    p.add_argument("--fp8-candidates", action="store_true",
                   help="only section 4: the FP8 key paths beside bf16 keys")  # fmt: skip
    p.add_argument("--only", default=None,
                   help="only the parts whose names contain this ('shared prefix')")  # fmt: skip
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
        ("decode B32 bf16 shared prefix", lambda: shared_decode(run, 32, bf)),
        ("prefill bf16", lambda: prefill(run, bf, False)),
        ("decode B1 fp8", lambda: decode(run, 1, FP8, False)),
        ("decode B32 fp8", lambda: decode(run, 32, FP8, False)),
        ("decode B32 fp8 shared prefix", lambda: shared_decode(run, 32, FP8)),
        ("prefill fp8", lambda: prefill(run, FP8, False)),
        ("decode B32 fp4", lambda: decode(run, 32, FP4, False)),  # V4.1 keys: unmeasured yet
        ("prefill fp4", lambda: prefill(run, FP4, False)),
    ]
    if args.fp8_candidates:
        parts = [("fp8 candidates", lambda: fp8_candidates(run))]
    elif not args.no_sweep:
        parts += [
            ("sweep decode B1 bf16", lambda: decode(run, 1, bf, True)),
            ("sweep decode B32 bf16", lambda: decode(run, 32, bf, True)),
            ("sweep prefill bf16", lambda: prefill(run, bf, True)),
            ("sweep decode B32 fp8", lambda: decode(run, 32, FP8, True)),
            ("sweep decode B32 fp4", lambda: decode(run, 32, FP4, True)),
        ]
    if args.only:
        parts = [(n, f) for n, f in parts if args.only in n]
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
    if not args.fp8_candidates:
        print(json.dumps(dict(meta=run.meta, rows=run.rows, sweep=run.sweep), indent=1))
    if args.json:
        print(f"wrote {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
