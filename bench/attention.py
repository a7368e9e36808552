"""Correctness and speed of the flash sparse attention (`adapters/kernels/attention.py`) on one
GPU (made for an H200), against the old path in the same process.

    python bench/attention.py [--json PATH] [--budget SECONDS] [--no-sweep] [--fp8-only]
    python bench/attention.py --smoke   # CPU, Triton interpreter, tiny fp32 shapes: the script

DeepSeek-V4-Flash shapes: 64 heads, d = 512 (bf16 latent, key = value), window 128, scale
``d**-0.5``. Cases: decode B = 1 and 32 with 512 selected C4 rows; decode B = 32 with 8192 C128
rows (slot table); prefill 4096 queries of one request with 512 selected rows each; prefill
4096 queries sharing one C128 slot-table row of 8192 entries, causal lengths
``(pos + 1) // 128`` at a 1M context.

1. Checks: the kernel against `sparse_attention_reference` computed in fp32 on the same bf16
   inputs (unrounded), per ``(query, head)`` row: the worst error in bf16 steps of the row's
   largest value (pass: <= 1); prefill on a spread subset of queries. Also an fp32 case (the
   exact path) and a CUDA-graph replay equal to the eager call bit for bit.
2. Timing, eager and inside a CUDA graph, the kernel and the old path (gather
   ``cat(window_kv[window_slots], extra_kv[extra.slots()])``, then `ops.sink_attention`; for the
   shared-C128 prefill, whose gathered keys would take ~100 GB, the tiled reference). Each
   timed call reads its own set of rows (``sets`` slot tables over pools of GBs) so that one
   measurement's rows exceed the L2; eager: CUDA events around a loop over the sets; graph:
   one graph of that loop, replayed. TFLOP/s: ``4 H d`` per visible (query, row); TB/s: the
   logical traffic, every visible row once per query plus q, out and the indices (shared C128
   rows are re-read per query, from L2: there the figure exceeds HBM bandwidth).
3. FP8 window: the SWA pool quantised to FP8 (`adapters.memory.formats.quantize`: e4m3 + one fp32
   scale per row, ``window_scale``), checked as in 1 against the reference on the same FP8 pool
   and timed next to the bf16 window, for decode B = 32 (C4) and the C4 prefill; every case on
   its own, so one failure does not hide the other. ``--fp8-only`` runs just this part.
4. Sweeps (time permitting): split-K shares for decode, then a few launch configurations.

The JSON records the commit (``--commit``, else the tree's git HEAD; both, and the sha256 of the
kernel and of this script), the command, the machine and the date.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
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

from adapters.kernels.attention_reference import sparse_attention_reference  # noqa: E402
from adapters.kernels.rows import PoolRows  # noqa: E402
from adapters.memory.formats import CacheFormat, quantize  # noqa: E402
from adapters.model import ops  # noqa: E402

SEED = 1234
SWEEP = [  # (block_h, block_k, num_warps, num_stages); the first is the default
    (64, 32, 8, 2),
    (64, 32, 8, 3),
    (64, 16, 8, 4),
    (64, 64, 8, 2),
    (32, 32, 4, 2),
]


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


class Shape:
    """The model's dimensions and the pools' sizes (tiny under ``--smoke``)."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.h, self.d, self.w = (4, 32, 8) if smoke else (64, 512, 128)
        self.topk, self.c128 = (16, 40) if smoke else (512, 8192)
        self.n_prefill = 6 if smoke else 4096
        self.batch = (1, 3) if smoke else (1, 32)
        self.swa_rows, self.c4_rows, self.c128_rows = (
            (64, 256, 128) if smoke else (1 << 18, 1 << 21, 1 << 19)
        )
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.scale = self.d**-0.5


class Case:
    """One shape: q, the pools and ``sets`` slot-table sets (window slots, mask, PoolRows)."""

    def __init__(
        self, name, q, wkv, xkv, sink, scale, sets, old="gather", window_scale=None
    ) -> None:
        self.name, self.q, self.wkv, self.xkv = name, q, wkv, xkv
        self.sink, self.scale = sink, scale
        self.sets, self.old = sets, old
        self.kwargs = {} if window_scale is None else {"window_scale": window_scale}
        ws, wm, extra = sets[0]
        n, h, d = q.shape
        wrows, xrows = int(wm.sum()), int(extra.lengths.clamp(0, extra.num_rows).sum())
        self.rows = wrows + xrows
        self.flops = 4 * h * d * self.rows
        e = q.element_size()
        wrow = d * wkv.element_size() + 8 + (0 if window_scale is None else 4)
        xrow = d * xkv.element_size() + 8
        self.bytes = wrows * wrow + xrows * xrow + 2 * n * h * d * e + ws.numel()

    def args(self, i):
        ws, wm, extra = self.sets[i % len(self.sets)]
        return (self.q, self.wkv, ws, wm, self.sink, self.scale, self.xkv, extra)

    def with_fp8_window(self, values, scales) -> Case:
        """The same shape and rows over an FP8 window pool (values + one scale per row)."""
        return Case(self.name + " FP8 window", self.q, values, self.xkv, self.sink, self.scale,
                    self.sets, self.old, window_scale=scales)  # fmt: skip

    @property
    def shape(self) -> str:
        ws, _, extra = self.sets[0]
        n, h, d = self.q.shape
        kind = "shared row" if extra.qrow is not None else "row per query"
        return f"N={n} H={h} d={d} W={ws.shape[1]} extra={extra.num_rows} ({kind})"


def _old_path(q, wkv, ws, wm, sink, scale, xkv, extra):
    keys = torch.cat((wkv[ws], xkv[extra.slots()]), 1)
    mask = torch.cat((wm, extra.mask()), 1)
    return ops.sink_attention(q, keys, mask, sink, scale)


def _old_tiled(q, wkv, ws, wm, sink, scale, xkv, extra):
    return sparse_attention_reference(q, wkv, ws, wm, sink, scale, xkv, extra, tile_bytes=1 << 31)


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.smoke = args.smoke
        self.dev = torch.device("cpu" if self.smoke else "cuda")
        self.s = Shape(self.smoke)
        self.t0 = time.monotonic()
        self.gen = torch.Generator(self.dev).manual_seed(SEED)
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.sweep: list[dict] = []
        self.fp8: list[dict] = []
        self._fp8_pool: tuple[torch.Tensor, torch.Tensor] | None = None
        from adapters.kernels import attention

        self.att = attention
        s = self.s
        self.wkv = self._randn(s.swa_rows, s.d)
        self.c4 = self._randn(s.c4_rows, s.d)
        self.c128 = self._randn(s.c128_rows, s.d)

    # -- helpers
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def _randn(self, *shape, dtype=None):
        x = torch.randn(*shape, generator=self.gen, device=self.dev)
        return x.to(dtype or self.s.dtype)

    def _randint(self, hi, shape):
        return torch.randint(0, hi, shape, generator=self.gen, device=self.dev)

    def _sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def _n_sets(self, call_bytes: int) -> int:
        if self.smoke:
            return 2
        return int(min(256, max(2, math.ceil(400e6 / max(call_bytes, 1)))))

    # -- cases
    def decode_case(self, b: int, c128: bool) -> Case:
        s = self.s
        g, pool, rows = (s.c128, self.c128, s.c128_rows) if c128 else (s.topk, self.c4, s.c4_rows)
        q = self._randn(b, s.h, s.d)
        sink = self._randn(s.h, dtype=torch.float32)
        call_bytes = b * (s.w + g) * s.d * 2
        sets = []
        for _ in range(self._n_sets(call_bytes)):
            ws = self._randint(s.swa_rows, (b, s.w))
            wm = torch.ones(b, s.w, dtype=torch.bool, device=self.dev)
            lengths = torch.full((b,), g, device=self.dev)
            if c128:
                lengths = lengths - self._randint(max(2, g // 64), (b,))
            sets.append((ws, wm, PoolRows(self._randint(rows, (b, g)), lengths)))
        name = f"decode B={b} " + (f"C128 {g} rows" if c128 else f"C4 top-{g}")
        return Case(name, q, self.wkv, pool, sink, s.scale, sets)

    def prefill_case(self, c128: bool) -> Case:
        s = self.s
        n = s.n_prefill
        ctx = 32 * s.c128 * 4 if self.smoke else 1 << 20
        pos = torch.arange(ctx - n, ctx, device=self.dev)
        q = self._randn(n, s.h, s.d)
        sink = self._randn(s.h, dtype=torch.float32)
        sets = []
        for _ in range(2):
            base = int(self._randint(s.swa_rows, (1,)))
            # the window of position p: rows of positions p-W+1..p in a ring of the SWA pool
            ws = (base + pos[:, None] - s.w + 1 + torch.arange(s.w, device=self.dev)) % s.swa_rows
            wm = torch.ones(n, s.w, dtype=torch.bool, device=self.dev)
            if c128:
                table = torch.randperm(s.c128_rows, generator=self.gen, device=self.dev)
                lengths = ((pos + 1) // 128).clamp(max=s.c128)
                qrow = torch.zeros(n, dtype=torch.long, device=self.dev)
                extra = PoolRows(table[None, : s.c128].contiguous(), lengths, qrow)
            else:
                lengths = torch.full((n,), s.topk, device=self.dev)
                extra = PoolRows(self._randint(s.c4_rows, (n, s.topk)), lengths)
            sets.append((ws, wm, extra))
        if c128:
            name = f"prefill N={n} C128 shared {s.c128} rows, causal"
            return Case(name, q, self.wkv, self.c128, sink, s.scale, sets, old="tiled")
        name = f"prefill N={n} C4 top-{s.topk}"
        return Case(name, q, self.wkv, self.c4, sink, s.scale, sets)

    # -- checks
    def check(self, case: Case, label: str = "", **knobs) -> dict:
        """Kernel vs the fp32 reference on a subset of queries, in bf16 steps per row."""
        n = case.q.shape[0]
        idx = torch.linspace(0, n - 1, min(n, 64), device=self.dev).round().long().unique()
        got = self.att.flash_sparse_attention(*case.args(0), **case.kwargs, **knobs)[idx].float()
        q, wkv, ws, wm, sink, scale, xkv, extra = case.args(0)
        sub = (
            PoolRows(extra.table[idx], extra.lengths[idx], None, extra.slots_per_page)
            if extra.qrow is None
            else PoolRows(extra.table, extra.lengths[idx], extra.qrow[idx], extra.slots_per_page)
        )
        truth = sparse_attention_reference(
            q[idx].float(), wkv, ws[idx], wm[idx], sink, scale, xkv, sub, **case.kwargs
        )
        rounded = truth.to(case.q.dtype).float()
        row_max = truth.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        step = torch.exp2(torch.floor(torch.log2(row_max)) - 7)
        if case.q.dtype == torch.float32:
            step = step / 2**9  # fp32: 2^-16 of the row's scale (the tests' 2e-5)
        steps = ((got - truth).abs() / step).amax()
        rec = dict(
            case=case.name + label,
            shape=case.shape,
            queries_checked=len(idx),
            max_err=float((got - truth).abs().max()),
            max_steps=float(steps),
            reference_rounding_steps=float(((rounded - truth).abs() / step).amax()),
            ok=bool(steps <= 1.0),
            knobs=knobs,
        )
        self.checks.append(rec)
        self.log(
            f"check {rec['case']:48} max err {rec['max_err']:.3e} = {rec['max_steps']:.3f} "
            f"steps (rounding alone {rec['reference_rounding_steps']:.3f}) "
            f"{'ok' if rec['ok'] else 'FAIL'}"
        )
        return rec

    def check_fp32(self) -> None:
        """The exact path (fp32 operands, FMA): random masks and lengths, small pools."""
        s = self.s
        n, g = 4, min(256, s.topk)
        wkv, xkv = self.wkv[: s.swa_rows // 4].float(), self.c4[: s.c4_rows // 8].float()
        q = self._randn(n, s.h, s.d, dtype=torch.float32)
        ws = self._randint(wkv.shape[0], (n, s.w))
        wm = self._randint(2, (n, s.w)).bool()
        extra = PoolRows(self._randint(xkv.shape[0], (n, g)), self._randint(g + 1, (n,)))
        sink = self._randn(s.h, dtype=torch.float32)
        self.check(Case("fp32 exact path", q, wkv, xkv, sink, s.scale, [(ws, wm, extra)]))

    # -- timing
    def _eager(self, fns, reps: int) -> float:
        for f in fns[:2]:
            f()
        self._sync()
        times = []
        for _ in range(reps):
            if self.smoke:
                t = time.perf_counter()
                for f in fns:
                    f()
                times.append((time.perf_counter() - t) * 1e6 / len(fns))
                continue
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for f in fns:
                f()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / len(fns))
        return statistics.median(times)

    def _graph(self, fns, reps: int) -> tuple[float, bool]:
        """Per-call µs of a graph of ``fns`` replayed ``reps`` times, and whether its last
        output equals an eager call bit for bit."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fns[-1]()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [f() for f in fns]
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / len(fns))
        same = bool(torch.equal(outs[-1], fns[-1]()))
        del graph, outs
        return statistics.median(times), same

    def time_impl(self, case: Case, impl: str, fn, sets=None, reps=None) -> dict:
        sets = len(case.sets) if sets is None else sets
        fns = [lambda i=i: fn(*case.args(i), **case.kwargs) for i in range(sets)]
        row = dict(case=case.name, shape=case.shape, impl=impl, sets=sets, error=None)
        try:
            fns[0]()  # compiles
            self._sync()
            t = time.perf_counter()
            fns[0]()
            self._sync()
            once = time.perf_counter() - t
            reps = reps or (2 if self.smoke else int(min(20, max(3, 0.3 / (once * sets + 1e-9)))))
            row["eager_us"] = self._eager(fns, reps)
            if not self.smoke:
                row["graph_us"], row["graph_equals_eager"] = self._graph(fns, reps)
        except Exception as exc:  # noqa: BLE001 - report and carry on
            row["error"] = _short(exc)
            row["traceback"] = traceback.format_exc()[-3000:]
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
        for mode in ("eager", "graph"):
            us = row.get(f"{mode}_us")
            if us:
                row[f"{mode}_tflops"] = case.flops / (us * 1e-6) / 1e12
                row[f"{mode}_tbps"] = case.bytes / (us * 1e-6) / 1e12
        self.rows.append(row)
        self.log(
            f"time {case.name:46} {impl:18} eager {_us(row.get('eager_us'))} graph "
            f"{_us(row.get('graph_us'))} | {_f(row.get('graph_tflops'))} TFLOP/s "
            f"{_f(row.get('graph_tbps'), 2)} TB/s"
            + (f" ERROR {row['error']}" if row["error"] else "")
        )
        return row

    def kernel_fn(self, **knobs):
        return lambda *a, **kw: self.att.flash_sparse_attention(*a, **kw, **knobs)

    def cases(self) -> list[Case]:
        b1, b32 = self.s.batch
        return [
            self.decode_case(b1, False),
            self.decode_case(b32, False),
            self.decode_case(b32, True),
            self.prefill_case(False),
            self.prefill_case(True),
        ]

    def main_part(self, cases) -> None:
        for case in cases:
            old = _old_tiled if case.old == "tiled" else _old_path
            row = self.time_impl(case, "flash kernel", self.kernel_fn())
            (n, h, d), (ws, _, extra) = case.q.shape, case.sets[0]
            width = ws.shape[1] + extra.num_rows
            row["config"] = self.att.launch_config(n, h, d, width, self.dev, self.smoke)
            heavy = case.old == "tiled" and not self.smoke
            self.time_impl(
                case, "old " + case.old, old, sets=1 if heavy else None, reps=2 if heavy else None
            )

    def fp8_window_pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The SWA pool in FP8 (values, per-row scales), quantised once."""
        if self._fp8_pool is None:
            fp8 = quantize(self.wkv, CacheFormat.FP8)
            self._fp8_pool = (fp8.values, fp8.scales)
        return self._fp8_pool

    def fp8_window(self, cases) -> None:
        """Each case with the FP8 window: checked, then timed right after its bf16 window."""
        for case in cases:
            try:
                fp8 = case.with_fp8_window(*self.fp8_window_pool())
            except Exception as exc:  # noqa: BLE001 - report and carry on
                self.log(f"fp8 window {case.name} ERROR {_short(exc)}")
                self.fp8.append(dict(case=case.name, error=_short(exc)))
                continue
            try:
                chk = self.check(fp8)
            except Exception as exc:  # noqa: BLE001
                chk = dict(ok=False, error=_short(exc))
                self.checks.append(dict(case=fp8.name, **chk))
                self.log(f"check {fp8.name} ERROR {chk['error']}")
            bf16 = self.time_impl(case, "flash, bf16 window", self.kernel_fn())
            mine = self.time_impl(fp8, "flash, FP8 window", self.kernel_fn())
            self.fp8.append(_fp8_row(case, bf16, mine, chk))

    def split_sweep(self, cases) -> None:
        for case in cases[:3]:
            for splits in (1, 2, 4, 8, 16):
                if self.elapsed() > self.args.budget:
                    return
                row = self.time_impl(case, f"splits={splits}", self.kernel_fn(splits=splits))
                self.sweep.append(dict(row, knobs=dict(splits=splits)))

    def config_sweep(self, cases) -> None:
        for case in (cases[1], cases[3], cases[4]):
            for bh, bk, warps, stages in SWEEP[1:]:
                if self.elapsed() > self.args.budget:
                    return
                knobs = dict(block_h=bh, block_k=bk, num_warps=warps, num_stages=stages)
                label = f"bh{bh} bk{bk} w{warps} s{stages}"
                try:
                    chk = self.check(case, f" [{label}]", **knobs)
                except Exception as exc:  # noqa: BLE001
                    chk = dict(ok=False, error=_short(exc))
                    self.log(f"check {case.name} [{label}] ERROR {chk['error']}")
                row = self.time_impl(case, label, self.kernel_fn(**knobs))
                self.sweep.append(dict(row, knobs=knobs, check_ok=chk.get("ok")))


def _us(x) -> str:
    return f"{x:9.1f} us" if x else "        - "


def _f(x, nd=1) -> str:
    return f"{x:.{nd}f}" if x else "-"


def _fp8_row(case: Case, bf16: dict, fp8: dict, chk: dict) -> dict:
    """The FP8 window against the bf16 one for ``case``: times, speed-ups and the check."""
    error = fp8.get("error") or bf16.get("error")
    row = dict(case=case.name, shape=case.shape, check_ok=chk.get("ok"), error=error)
    row["check_steps"] = chk.get("max_steps")
    for mode in ("eager", "graph"):
        a, b = bf16.get(f"{mode}_us"), fp8.get(f"{mode}_us")
        row.update({f"bf16_{mode}_us": a, f"fp8_{mode}_us": b})
        row[f"{mode}_speedup"] = a / b if a and b else None
    return row


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None
    except OSError:
        return None


def meta(args) -> dict:
    files = ["adapters/kernels/attention.py", "bench/attention.py"]
    head = _git("rev-parse", "HEAD")  # a copied tree's .git may lag: --commit wins
    m = dict(
        command=" ".join(["python", *sys.argv]),
        date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        commit=args.commit or head,
        commit_source="--commit" if args.commit else "git",
        git_head=head,
        dirty=args.dirty if args.commit else bool(_git("status", "--porcelain")),
        sha256={f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest()[:16] for f in files},
        python=platform.python_version(),
        torch=torch.__version__,
        seed=SEED,
        smoke=args.smoke,
    )
    import triton

    m["triton"] = triton.__version__
    if torch.cuda.is_available() and not args.smoke:
        props = torch.cuda.get_device_properties(0)
        m.update(machine=torch.cuda.get_device_name(0), sms=props.multi_processor_count)
    else:
        m["machine"] = f"cpu ({platform.machine()}), Triton interpreter"
    return m


def report(bench: Bench) -> str:
    out = [
        "",
        "| case | impl | eager µs | graph µs | TFLOP/s (graph) | TB/s (graph) | × old (graph) |",
    ]
    out.append("|---|---|---:|---:|---:|---:|---:|")
    old = {r["case"]: r for r in bench.rows if r["impl"].startswith("old")}
    for r in bench.rows:
        base = old.get(r["case"], {}).get("graph_us") or old.get(r["case"], {}).get("eager_us")
        mine = r.get("graph_us") or r.get("eager_us")
        speed = f"{base / mine:.1f}" if base and mine and not r["impl"].startswith("old") else ""
        out.append(
            f"| {r['case']} | {r['impl']} | {_f(r.get('eager_us'))} | {_f(r.get('graph_us'))} | "
            f"{_f(r.get('graph_tflops') or r.get('eager_tflops'))} | "
            f"{_f(r.get('graph_tbps') or r.get('eager_tbps'), 2)} | {speed} |"
            + (f" ERROR {r['error']}" if r.get("error") else "")
        )
    if bench.fp8:
        out += ["", "| case | bf16 window µs (graph) | FP8 window µs (graph) | × bf16 | check |"]
        out.append("|---|---:|---:|---:|---|")
        for r in bench.fp8:
            a = r.get("bf16_graph_us") or r.get("bf16_eager_us")
            b = r.get("fp8_graph_us") or r.get("fp8_eager_us")
            ok = {True: "ok", False: "FAIL", None: "-"}[r.get("check_ok")]
            out.append(
                f"| {r['case']} | {_f(a)} | {_f(b)} | {f'{a / b:.2f}' if a and b else ''} | {ok} |"
                + (f" ERROR {r['error']}" if r.get("error") else "")
            )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, help="write every row and check to this file")
    p.add_argument("--budget", type=float, default=170.0, help="seconds before sweeps stop")
    p.add_argument("--no-sweep", action="store_true", help="skip the sweeps")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    p.add_argument("--fp8-only", action="store_true", help="only the FP8-window part (3.)")
    p.add_argument("--commit", default=None, help="the commit (over the tree's own .git)")
    p.add_argument("--dirty", action="store_true", help="with --commit: the tree had changes")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or use --smoke to exercise the script on the CPU")
        return 2
    torch.manual_seed(SEED)
    info = meta(args)
    print(f"setup: {info}", flush=True)
    bench = Bench(args)

    def dump() -> None:
        info["seconds"] = round(bench.elapsed(), 1)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            data = dict(
                meta=info, checks=bench.checks, rows=bench.rows, sweep=bench.sweep,
                fp8_window=bench.fp8,
            )  # fmt: skip
            args.json.write_text(json.dumps(data, indent=1))

    if args.fp8_only:
        fp8_cases = [bench.decode_case(bench.s.batch[1], False), bench.prefill_case(False)]
        parts = [("fp8 window", lambda: bench.fp8_window(fp8_cases))]
        cases = []
    else:
        cases = bench.cases()
        parts = [
            ("checks", lambda: [bench.check(c) for c in cases]),
            ("fp32 check", bench.check_fp32),
            ("timing", lambda: bench.main_part(cases)),
            ("fp8 window", lambda: bench.fp8_window([cases[1], cases[3]])),
        ]
    if not args.no_sweep and not args.fp8_only:
        parts += [("split sweep", lambda: bench.split_sweep(cases))]
        parts += [("config sweep", lambda: bench.config_sweep(cases))]
    for name, part in parts:
        bench.log(f"--- {name}")
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - a broken part must not hide the others
            bench.log(f"{name} aborted: {_short(exc)}")
            traceback.print_exc()
        dump()
    print(report(bench))
    print(f"\n(total {bench.elapsed():.1f} s)")
    if args.json:
        print(f"wrote {args.json}")
    return 0 if all(c.get("ok") for c in bench.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
