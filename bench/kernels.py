"""Correctness and speed of the Triton kernels in `adapters.kernels` on one GPU (made for an H200).

    python bench/kernels.py [--json PATH] [--budget SECONDS] [--only compress|topk] [--no-sweep]
    python bench/kernels.py --smoke          # CPU, Triton interpreter, tiny shapes: the script
    python bench/kernels.py --compile-check  # no GPU: compile every kernel config for sm_90

Every variant is first checked against the PyTorch reference (compressor: relative L2 and max
abs error against an fp32 reference computed from the same inputs; top-k: exact equality of
indices, values and counts with the stable-sort reference), then timed; a variant that raises
is reported as such and the rest still runs. Timing: the median of CUDA-event measurements; runs
shorter than ~0.3 ms (2 ms for the top-k and decode rows, whose single eager call is dominated by
Python launch overhead) are timed as CUDA-graph replays of several calls (no launch gaps, inputs
stay in L2, for the kernel and its baseline alike); longer ones with `triton.testing.do_bench`
(L2 flushed). Baselines run in the same process on the same inputs: the naive PyTorch
compression chain, and `torch.topk`. TB/s counts the minimum traffic: inputs read once
(kv + score, or the gathered ring rows) plus entries written once.

Order: the target rows first (C4-overlap and C128 compression, top-k at 1 and 32 rows), then the
other shapes and variants, the exactness checks on hard inputs, and last the launch-knob sweeps.
The tables go to stdout (markdown) at the end, with a target summary; `--json` writes every row.
The run stays within ``--budget`` seconds (default 120): when it is spent, the sweeps are
skipped and listed as skipped; past 1.25 times the budget everything left is skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
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

from bench.timing import graph_us  # noqa: E402

SEED = 1234


class Budget:
    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


class Timer:
    """Median time of ``fn()`` in microseconds (see the module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn, graph_ms: float = 0.3) -> tuple[float, str]:
        if self.device.type != "cuda":
            fn()
            runs = []
            for _ in range(2):
                t = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - t)
            return statistics.median(runs) * 1e6, "wall"
        fn()  # compile / warm up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        once_ms = start.elapsed_time(end)
        note = ""
        if once_ms < graph_ms:
            try:
                return self._graph(fn, once_ms), "graph"
            except Exception as exc:  # noqa: BLE001 - fall back to eager timing
                note = f" (graph failed: {_short(exc)[:80]})"
                torch.cuda.synchronize()
        import triton.testing

        warm = max(10.0, 3 * once_ms)
        rep = min(400.0, max(50.0, 25 * once_ms))
        ms = triton.testing.do_bench(fn, warmup=warm, rep=rep, return_mode="median")
        return ms * 1e3, "do_bench" + note

    @staticmethod
    def _graph(fn, once_ms: float) -> float:
        calls = int(min(100, max(5, 1.0 / max(once_ms, 1e-3))))
        return graph_us(fn, calls=calls, replays=20, warm=3)


def _ops():
    from adapters.model import ops

    return ops


def _index_order(values, indices, counts):
    """The real entries of each row by index ascending (the padding stays last)."""
    real = torch.arange(indices.shape[1], device=indices.device)[None] < counts[:, None].long()
    order = torch.argsort(torch.where(real, indices, indices.shape[1] + (1 << 40)), dim=1)
    return values.gather(1, order), indices.gather(1, order), counts


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:160]


def _fmt(x, nd=1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return str(x)


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.smoke = args.smoke
        self.device = torch.device("cpu" if self.smoke else "cuda")
        self.timer = Timer(self.device)
        self.budget = Budget(args.budget)
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.errors_seen: set[str] = set()

    # -- bookkeeping
    def log(self, msg: str) -> None:
        print(f"[{self.budget.elapsed():6.1f}s] {msg}", flush=True)

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.log(
            f"{row['kernel']:9} {row['variant']:34} {row['shape']:30} "
            f"{_fmt(row.get('us'))} us  {row.get('check', '')}"
            + (f"  ERROR {row['error']}" if row.get("error") else "")
        )
        return row

    def variant(
        self,
        kernel,
        variant,
        shape,
        run,
        check=None,
        traffic=None,
        base=None,
        optional=False,
        graph_ms=0.3,
    ):
        """Checks then times ``run``; returns the row (``us`` None on failure)."""
        row = dict(
            kernel=kernel,
            variant=variant,
            shape=shape,
            us=None,
            tbps=None,
            speedup=None,
            check="",
            error=None,
            timing="",
        )
        if self.budget.left() < (0 if optional else -0.25 * self.budget.seconds):
            row["check"] = "skipped (time budget)"
            return self.add(row)
        try:
            if check is not None:
                row["check"] = check()
            row["us"], row["timing"] = self.timer(run, graph_ms)
            if traffic:
                row["tbps"] = traffic / (row["us"] * 1e-6) / 1e12
            if base is not None and base.get("us"):
                row["speedup"] = base["us"] / row["us"]
        except Exception as exc:  # noqa: BLE001 - report and carry on
            self._failed(row, exc)
        return self.add(row)

    def _failed(self, row: dict, exc: BaseException) -> None:
        row["error"] = _short(exc)
        row["traceback"] = traceback.format_exc()[-4000:]
        if row["error"] not in self.errors_seen:  # each distinct error's traceback once
            self.errors_seen.add(row["error"])
            print(row["traceback"], flush=True)
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as again:  # noqa: BLE001 - a sticky CUDA error: keep reporting
                print(f"CUDA is unusable after this error: {_short(again)}", flush=True)

    def check(self, case: str, fn) -> None:
        if self.budget.left() < -0.25 * self.budget.seconds:
            self.checks.append(dict(case=case, result="skipped (time budget)"))
            return
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001
            result = "ERROR " + _short(exc)
        self.checks.append(dict(case=case, result=result))
        self.log(f"check {case}: {result}")

    # -- compressor
    SHAPES = {  # name: (tokens, d, ratio, overlap)
        "C4 overlap": (1 << 20, 512, 4, True),
        "C4 no overlap": (1 << 20, 512, 4, False),
        "C128": (1 << 20, 512, 128, False),
    }
    SMOKE_SHAPES = {"C4 overlap": (64, 32, 4, True), "C128": (512, 32, 128, False)}
    SWEEPS = {  # launch-knob variants (the sweep phase, last)
        "C4 overlap": [
            dict(block_g=4),
            dict(block_g=1),
            dict(block_g=4, block_d=256),
            dict(rows_chunk=2),
        ],
        "C4 no overlap": [dict(block_g=4), dict(block_g=1), dict(block_g=4, block_d=256)],
        "C128": [
            dict(rows_chunk=8),
            dict(block_g=1),
            dict(block_g=4),
            dict(row_warps=2),
        ],
    }

    def compress(self, names, sweep: bool = False) -> None:
        """Baseline, the default kernel and the fused epilogue for each named shape; with
        ``sweep``, the launch-knob variants instead."""
        shapes = self.SMOKE_SHAPES if self.smoke else self.SHAPES
        for name in names:
            if name in shapes and (not sweep or name in self.SWEEPS):
                self._compress_shape(name, *shapes[name], sweep=sweep)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _compress_shape(
        self, name: str, t: int, d: int, ratio: int, overlap: bool, sweep: bool
    ) -> None:
        from adapters.kernels import compressor as C
        from adapters.kernels import reference as R

        dev = self.device
        w = (2 if overlap else 1) * d
        shape = f"{t:,}x{w} bf16 r{ratio}"
        rope = 64 if d >= 128 else 8
        if self.budget.left() < (0 if sweep else -0.25 * self.budget.seconds):
            self.add(
                dict(
                    kernel="compress",
                    variant=name,
                    shape=shape,
                    us=None,
                    check="skipped (time budget)",
                )
            )
            return
        try:
            g = torch.Generator(device=dev).manual_seed(SEED)
            kv = torch.randn(t, w, generator=g, device=dev).to(torch.bfloat16)
            score = (torch.randn(t, w, generator=g, device=dev) * 2).to(torch.bfloat16)
            ape = torch.randn(ratio, w, generator=g, device=dev).to(torch.bfloat16)
            norm = torch.rand(d, generator=g, device=dev) + 0.5
            f32 = torch.float32
            want = R.compress_reference(kv, score, ape, ratio, overlap, out_dtype=f32)
            want_e = None
            if not sweep:
                want_e = R.compress_reference(
                    kv, score, ape, ratio, overlap, norm=norm, rope_dim=rope, out_dtype=f32
                )
        except Exception as exc:  # noqa: BLE001
            err = "setup: " + _short(exc)
            self.add(dict(kernel="compress", variant=name, shape=shape, us=None, error=err))
            return
        groups = t // ratio
        traffic = 2 * groups * ratio * w * 2 + groups * d * 2

        def checker(fn, ref, tol, timed=None):
            """``fn`` (fp32 output) within ``tol``; ``timed`` (the bf16 output that is timed)
            within bf16 rounding too."""

            def one(out, tol):
                diff = (out.float() - ref).abs()
                rel = float(diff.norm() / ref.norm().clamp_min(1e-30))
                bad = not math.isfinite(rel) or rel > tol or bool(out.isnan().any())
                return bad, f"rel {rel:.1e} max {float(diff.max()):.1e}"

            def go():
                bad, text = one(fn(), tol)
                if timed is not None:
                    bad16, text16 = one(timed(), 5e-3)
                    bad, text = bad or bad16, f"{text}; bf16 out {text16}"
                return f"{'FAIL' if bad else 'ok'} {text}"

            return go

        def naive():
            return R.naive_torch_chain(kv, score, ape, ratio, overlap)

        def flash(**kw):
            return C.flash_compress(kv, score, ape, ratio, overlap, **kw)

        def strict(**kw):
            # fp32 output into a NaN-poisoned buffer: every element written, fp32-exact
            out = torch.full((groups, d), float("nan"), device=dev)
            C.flash_compress(kv, score, ape, ratio, overlap, out=out, **kw)
            return out

        if sweep:
            base = self._find(f"{name}: naive torch chain", shape)
            for knobs in self.SWEEPS[name]:
                label = ",".join(f"{k}={v}" for k, v in knobs.items())
                self.variant(
                    "compress",
                    f"{name}: flash {label}",
                    shape,
                    lambda knobs=knobs: flash(**knobs),
                    checker(
                        lambda knobs=knobs: strict(**knobs),
                        want,
                        1e-5,
                        lambda knobs=knobs: flash(**knobs),
                    ),
                    traffic,
                    base,
                    optional=True,
                )
            return
        cfg = C.launch_config(ratio, overlap, d, 2, False, groups, False)
        self.log(f"compress {name}: launch {cfg}")
        base = self.variant(
            "compress",
            f"{name}: naive torch chain",
            shape,
            naive,
            checker(naive, want, 2e-2),
            traffic,
        )
        self.variant(
            "compress",
            f"{name}: flash",
            shape,
            flash,
            checker(strict, want, 1e-5, flash),
            traffic,
            base,
        )
        kw_e = dict(norm=norm, rope_dim=rope)
        self.variant(
            "compress",
            f"{name}: flash +norm+rope",
            shape,
            lambda: flash(**kw_e),
            checker(lambda: strict(**kw_e), want_e, 1e-5, lambda: flash(**kw_e)),
            traffic,
            base,
        )

    def compress_decode(self) -> None:
        from adapters.kernels import compressor as C
        from adapters.kernels import reference as R

        dev = self.device
        d = 32 if self.smoke else 512
        b_list = [4] if self.smoke else [32, 128]
        for ratio, overlap in [(4, True), (128, False)]:
            if self.smoke and ratio == 128:
                ratio = 16
            c = 2 if overlap else 1
            w = c * d
            rlen = 2 * ratio if overlap else ratio
            for b in b_list:
                shape = f"B{b} ring fp32 {rlen}x{2 * w} r{ratio}"
                try:
                    g = torch.Generator(device=dev).manual_seed(SEED + b)
                    n_ring = b * rlen * 2
                    ring = torch.randn(n_ring, 2 * w, generator=g, device=dev)
                    ring[:, w:] *= 2
                    rows = torch.randperm(n_ring, generator=g, device=dev)[: b * rlen].view(b, rlen)
                    group = torch.randint(0, 5000, (b,), generator=g, device=dev)
                    group[0] = 0
                    pad = torch.zeros(b, rlen, dtype=torch.bool, device=dev)
                    if overlap:
                        pad[0, :ratio] = True  # the first group: previous group is padding
                    norm = torch.rand(d, generator=g, device=dev) + 0.5
                    kw = dict(pad=pad, groups=group, norm=norm, rope_dim=64 if d >= 128 else 8)
                    want = R.compress_gathered_reference(ring, rows, ratio, overlap, **kw)
                except Exception as exc:  # noqa: BLE001
                    self.add(
                        dict(
                            kernel="compress",
                            variant="decode",
                            shape=shape,
                            us=None,
                            error="setup: " + _short(exc),
                        )
                    )
                    continue
                traffic = b * rlen * 2 * d * 4 + b * d * 4 + b * rlen * 9

                def chk(fn, want=want):
                    def go():
                        out = fn()
                        rel = float((out - want).norm() / want.norm())
                        return f"{'FAIL' if not rel <= 1e-5 else 'ok'} rel {rel:.1e}"

                    return go

                base = self.variant(
                    "compress",
                    "decode: torch chain (gather,pool,norm,rope)",
                    shape,
                    lambda kw=kw, ring=ring, rows=rows, ratio=ratio, overlap=overlap: (
                        R.compress_gathered_reference(ring, rows, ratio, overlap, **kw)
                    ),
                    None,
                    traffic,
                    graph_ms=2.0,
                )

                def fl(kw=kw, ring=ring, rows=rows, ratio=ratio, overlap=overlap):
                    return C.flash_compress_gathered(ring, rows, ratio, overlap, **kw)

                self.variant(
                    "compress",
                    "decode: flash gathered +norm+rope",
                    shape,
                    fl,
                    chk(fl),
                    traffic,
                    base,
                    graph_ms=2.0,
                )

    # -- top-k
    def _tk(self):
        import importlib

        return importlib.import_module(
            "adapters.kernels.topk_lightning"
        )  # the package's `topk` is a function

    @staticmethod
    def _exact(fn, x, k, lengths=None, sort=False):
        from adapters.kernels import reference as R

        def go():
            got = fn()
            if not sort:  # a deterministic order: compare as the reference's index order
                got = _index_order(*got)
            want = R.topk_reference(x, k, lengths, sorted=sort)
            names = ("values", "indices", "counts")
            bad = [nm for a, b_, nm in zip(got, want, names) if not torch.equal(a, b_)]
            again = fn() if sort else _index_order(*fn())
            same = all(torch.equal(a, b_) for a, b_ in zip(got, again))
            if bad:
                return "FAIL " + "/".join(bad)
            return "exact" + ("" if same else " but NOT deterministic")

        return go

    def _topk_input(self, b, n, k):
        g = torch.Generator(device=self.device).manual_seed(SEED + b + k)
        return torch.randn(b, n, generator=g, device=self.device), g

    def topk(self, phase: str) -> None:
        """``targets``: the two target shapes; ``main``: the other shapes and variants;
        ``sweep``: launch-knob variants at the headline shape."""
        TK = self._tk()
        dev = self.device
        n0 = 4096 if self.smoke else 262_144
        if phase == "targets":
            self.log(f"topk: tl.histogram mask support = {TK.HIST_MASK}")
            shapes = [
                (1, n0, 512 if not self.smoke else 64),
                (32 if not self.smoke else 3, n0, 64 if self.smoke else 512),
            ]
        elif phase == "main":
            if self.smoke:
                shapes = [(1, 2 * n0, 128)]
            else:
                shapes = [
                    (8, n0, 512),
                    (128, n0, 512),
                    (1, 1 << 20, 512),
                    (1, n0, 1024),
                    (1, n0, 2048),
                ]
        else:
            shapes = []
        for b, n, k in shapes:
            self._topk_shape(TK, b, n, k, targets=phase == "targets")
        if phase == "main":  # sorted output and ragged lengths at the target shapes
            for b, n, k in [(1, n0, 512), (32, n0, 512)] if not self.smoke else [(3, n0, 64)]:
                shape = f"{b}x{n:,} k={k}"
                x, g = self._topk_input(b, n, k)
                base = self._find("torch.topk", shape)
                run = functools.partial(TK.lightning_topk, x, k, sorted=True)
                self.variant(
                    "topk",
                    "lightning sorted",
                    shape,
                    run,
                    self._exact(run, x, k, sort=True),
                    None,
                    base,
                    graph_ms=2.0,
                )
                if b > 1:
                    lens = torch.randint(0, n + 1, (b,), generator=g, device=dev)
                    lens[:4] = torch.tensor([0, 100, k, n], device=dev)[: min(4, b)]
                    run = functools.partial(TK.lightning_topk, x, k, lens)
                    self.variant(
                        "topk",
                        "lightning lengths",
                        shape,
                        run,
                        self._exact(run, x, k, lens),
                        None,
                        base,
                        graph_ms=2.0,
                    )
                del x
        if phase == "sweep":
            b, n, k = (1, n0, 512 if not self.smoke else 64)
            shape = f"{b}x{n:,} k={k}"
            x, _ = self._topk_input(b, n, k)
            base = self._find("torch.topk", shape)
            knobs_list = [
                dict(num_warps=4),
                dict(hist_mask=not TK.HIST_MASK),
                dict(pdl=False, workspace=TK.topk_workspace(b, dev)),
            ]
            todo = [(b, n, k, kn) for kn in knobs_list]
            b32 = 32 if not self.smoke else 3
            todo += [
                (b32, n, k, dict(algorithm="histogram", ctas=c))
                for c in ((8, 32) if not self.smoke else (2,))
            ]
            bound = [dict(ctas=c) for c in (8, 32)] + [dict(chunk=c) for c in (64, 256)]
            bound += [dict(block=c) for c in (1024, 4096)] + [dict(num_warps=w) for w in (4, 16)]
            bound += [dict(block=1024, num_warps=4), dict(bound_warps=(4, 8))]
            bound += [dict(tile=c) for c in (1024, 4096)]
            todo += [(b32, n, k, dict(algorithm="bound", **kn)) for kn in bound]
            todo += [(b, n, k, dict(algorithm="histogram", block=c)) for c in (512, 2048)]
            todo += [(b, n, k, dict(algorithm="histogram", ctas=c)) for c in (128, 512)]
            todo += [(8, n, k, dict(algorithm=a)) for a in ("histogram", "bound")]
            todo += [(16, n, k, dict(algorithm=a)) for a in ("histogram", "bound")]
            for b, n, k, knobs in todo if not self.smoke else todo[:1] + todo[-3:]:
                shape = f"{b}x{n:,} k={k}"
                x, _ = self._topk_input(b, n, k)
                base = self._find("torch.topk", shape)
                label = ",".join(
                    f"{a}={'reused' if a == 'workspace' else v}" for a, v in knobs.items()
                )
                run = functools.partial(TK.lightning_topk, x, k, **knobs)
                self.variant(
                    "topk",
                    f"lightning {label}",
                    shape,
                    run,
                    self._exact(run, x, k),
                    None,
                    base,
                    optional=True,
                    graph_ms=2.0,
                )

    def _topk_shape(self, TK, b, n, k, targets):
        dev = self.device
        shape = f"{b}x{n:,} k={k}"
        x, _ = self._topk_input(b, n, k)
        gm = dict(graph_ms=2.0)
        base = self.variant("topk", "torch.topk", shape, lambda: torch.topk(x, k), **gm)
        run = functools.partial(TK.lightning_topk, x, k)
        self.variant(
            "topk", "lightning (default)", shape, run, self._exact(run, x, k), None, base, **gm
        )
        for algo in ("histogram", "bound"):
            run = functools.partial(TK.lightning_topk, x, k, algorithm=algo)
            self.variant(
                "topk", f"lightning {algo}", shape, run, self._exact(run, x, k), None, base, **gm,
            )  # fmt: skip
        if targets:
            for label, hard in self._bound_hard_inputs(x, k).items():
                for algo in ("histogram", "bound"):
                    run = functools.partial(TK.lightning_topk, hard, k, algorithm=algo)
                    self.variant(
                        "topk", f"lightning {algo} {label}", shape, run,
                        self._exact(run, hard, k), None, base, optional=True, **gm,
                    )  # fmt: skip
            ws = TK.topk_workspace(b, dev)
            run = functools.partial(TK.lightning_topk, x, k, workspace=ws)
            self.variant(
                "topk",
                "lightning reused workspace",
                shape,
                run,
                self._exact(run, x, k),
                None,
                base,
                **gm,
            )
            if dev.type == "cuda":
                run = functools.partial(TK.lightning_topk, x, k, pdl=False)
                self.variant(
                    "topk",
                    "lightning pdl=False",
                    shape,
                    run,
                    self._exact(run, x, k),
                    None,
                    base,
                    **gm,
                )
            if b in (1, 32):  # the model's current exact top-k: int64 keys through torch.topk
                self.variant(
                    "topk",
                    "ops.topk_lowest_index (model today)",
                    shape,
                    lambda: _ops().topk_lowest_index(x, k),
                    None,
                    None,
                    base,
                    **gm,
                )

    def _bound_hard_inputs(self, x, k):
        """Inputs that weaken the chunk-maxima bound: the top entries packed into few chunks
        (16 runs of 256 raised entries per row), and ascending rows (the worst case: the top
        ``k`` chunks are full, ``k * chunk`` candidates)."""
        b, n = x.shape
        g = torch.Generator(device=self.device).manual_seed(SEED + 99)
        runs = x.clone()
        starts = torch.randint(0, max(1, n - 256), (b, 16), generator=g, device=self.device)
        cols = (starts[:, :, None] + torch.arange(256, device=self.device)).reshape(b, -1)
        runs.scatter_add_(1, cols, torch.full_like(cols, 4.0, dtype=x.dtype))
        ramp = torch.arange(n, device=self.device, dtype=x.dtype).expand(b, n).contiguous()
        ties = torch.randint(0, 3, (b, n), generator=g, device=self.device).to(x.dtype)
        page = x.clone()  # the first entry of every 64 raised: periodic, a power of two
        page[:, ::64] += 4.0
        return {
            "runs of 256": runs,
            "ascending rows": ramp + 0.25 * x,
            "every 64th raised": page,
            "ties {0,1,2}": ties,
        }

    def topk_checks(self) -> None:
        """Exactness on hard inputs (not timed)."""
        TK = self._tk()
        dev = self.device
        extra = [(2, 4096, 64)] if self.smoke else [(8, 262_144, 512), (32, 262_144, 2048)]
        for b, n, k in extra:
            g = torch.Generator(device=dev).manual_seed(SEED + 7)
            cases = {}
            cases["ties {0,1,2}"] = (
                torch.randint(0, 3, (b, n), generator=g, device=dev).float(),
                None,
            )
            cases["all equal"] = (torch.full((b, n), 0.25, device=dev), None)
            y = torch.randn(b, n, generator=g, device=dev)
            y[:, n // 3 :] = float("-inf")
            y[0, :] = float("-inf")
            cases["-inf padding"] = (y, None)
            z = torch.randint(-1, 2, (b, n), generator=g, device=dev).float() * 0.0  # +-0.0
            z[:, ::7] = -0.0
            cases["+0.0/-0.0"] = (z, None)
            lens = torch.randint(0, 3 * k, (b,), generator=g, device=dev)
            lens[0] = 0
            cases["lengths < k"] = (torch.randn(b, n, generator=g, device=dev), lens)
            cases["ties + lengths"] = (cases["ties {0,1,2}"][0], lens + n // 2)
            # one dense 16-bit bin (distinct keys): the tail refines over many candidates
            cases["dense bin"] = (1.0 + torch.rand(b, n, generator=g, device=dev) * 2**-8, None)
            # ascending: every selected entry in the last CTA's range
            cases["ascending"] = (torch.arange(n, device=dev).float().repeat(b, 1), None)
            for case, (x, lens) in cases.items():
                for sort in (False, True):
                    label = f"{case} {b}x{n} k={k}" + (" sorted" if sort else "")
                    run = functools.partial(TK.lightning_topk, x, k, lens, sorted=sort)
                    self.check(label, self._exact(run, x, k, lens, sort))

    # -- compile-only check (no GPU needed)
    def compile_check(self, arch: int) -> None:
        """Compiles every kernel configuration the benchmark launches for ``sm_<arch>`` with the
        installed Triton (no GPU needed) and prints registers, spills and the shared-memory /
        barrier instruction counts of the SASS (when Triton ships nvdisasm)."""
        import importlib
        import re
        import subprocess
        import tempfile
        from collections import Counter

        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler import compile as tcompile

        from adapters.kernels import compressor as C

        TK = importlib.import_module("adapters.kernels.topk_lightning")
        target = GPUTarget("cuda", arch, 32)
        tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        failures = 0

        def stats(k):
            if not (tools / "nvdisasm").exists():
                return ""
            with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                f.write(k.asm["cubin"])
            try:
                sass = subprocess.run(
                    [tools / "nvdisasm", "-c", f.name], capture_output=True, text=True
                ).stdout
                res = ""
                if (tools / "cuobjdump").exists():
                    out = subprocess.run(
                        [tools / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True
                    ).stdout
                    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out, re.S)
                    res = f"regs={m.group(1)} stack={m.group(2)} " if m else ""
            finally:
                os.unlink(f.name)
            ops = Counter()
            for line in sass.splitlines():
                m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
                if m:
                    ops[m.group(1)] += 1
            keep = ("BAR", "LDS", "STS", "LDL", "STL", "LDG", "STG")
            return res + " ".join(f"{o}={ops[o]}" for o in keep if ops[o])

        def build(fn, types, consts, num_warps, label, **opts):
            nonlocal failures
            names = fn.arg_names
            sig = {a: ("constexpr" if a in consts else types[a]) for a in names}
            div = [
                a
                for a in names
                if a not in consts
                and (a.endswith("_ptr") or a.startswith("stride") or a in ("N", "HN", "span", "M"))
            ]
            attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div}
            t0 = time.monotonic()
            try:
                k = tcompile(
                    ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                    target=target,
                    options=dict(num_warps=num_warps, **opts),
                )
                print(
                    f"ok   {label:58} {time.monotonic() - t0:4.1f}s "
                    f"shared={k.metadata.shared} {stats(k)}",
                    flush=True,
                )
            except Exception as exc:  # noqa: BLE001
                failures += 1
                print(f"FAIL {label:58} {_short(exc)}", flush=True)

        ptr = dict(bf16="*bf16", fp32="*fp32")
        for dt, gather, ratio, overlap, epi, n, out in [
            ("bf16", False, 4, True, False, 1 << 18, "bf16"),
            ("bf16", False, 4, False, False, 1 << 18, "bf16"),
            ("bf16", False, 128, False, False, 1 << 13, "bf16"),
            ("bf16", False, 4, True, True, 1 << 18, "bf16"),
            ("bf16", False, 4, False, True, 1 << 18, "bf16"),
            ("bf16", False, 128, False, True, 1 << 13, "bf16"),
            ("bf16", False, 4, True, False, 1 << 18, "fp32"),  # the benchmark's strict check
            ("bf16", False, 128, False, True, 1 << 13, "fp32"),
            ("fp32", True, 4, True, True, 32, "fp32"),
            ("fp32", True, 4, True, True, 128, "fp32"),
            ("fp32", True, 128, False, True, 32, "fp32"),
            ("fp32", True, 128, False, True, 128, "fp32"),
        ]:
            eb = 2 if dt == "bf16" else 4
            cfg = C.launch_config(ratio, overlap, 512, eb, epi, n, gather)
            warps = cfg.pop("num_warps")
            types = dict(
                kv_ptr=ptr[dt],
                sc_ptr=ptr[dt],
                ape_ptr=ptr[dt],
                rows_ptr="*i64",
                pad_ptr="*u8",
                grp_ptr="*i64",
                norm_ptr="*fp32",
                freq_ptr="*fp32",
                out_ptr=ptr[out],
                G="i32",
                stride_kv="i32",
                stride_sc="i32",
                stride_ape="i32",
                stride_r="i32",
                stride_out="i32",
                group_offset="i32",
                eps="fp32",
            )
            consts = dict(
                DIM=512,
                RATIO=ratio,
                OVERLAP=overlap,
                GATHER=gather,
                HAS_APE=not gather,
                HAS_PAD=gather,
                EPILOGUE=epi,
                HALF=32 if epi else 0,
                FAST_TRIG=True,
                **cfg,
            )
            flags = [("overlap", overlap), ("gather", gather), ("+epi", epi)]
            label = " ".join(
                [f"compress {dt} r{ratio}"] + [f for f, on in flags if on] + [f"n={n} -> {out}"]
            )
            build(C._compress_kernel, types, consts, warps, label)
        types = dict(
            x_ptr="*fp32",
            len_ptr="*i32",
            st_ptr="*i32",
            ge_ptr="*i32",
            cv_ptr="*fp32",
            ci_ptr="*i32",
            val_ptr="*fp32",
            idx_ptr="*i64",
            cnt_ptr="*i32",
            N="i32",
            HN="i32",
            stride_x="i32",
            span="i32",
            k="i32",
            C="i32",
            tr_ptr="*i64",
        )
        for pdl in (True, False):
            for has_len in (False, True):
                c = dict(BLOCK=2048, HAS_LEN=has_len, HIST_MASK=TK.HIST_MASK, PDL=pdl, TRACE=pdl)
                tag = f"pdl={pdl} lengths={has_len}"
                types["len_ptr"] = "*i64" if has_len else "*i32"  # int64 lengths, or counts
                build(TK._hist1_kernel, types, c, 8, f"topk hist1 {tag}")
                build(TK._hist2_kernel, types, c, 8, f"topk hist2 {tag}", launch_pdl=pdl)
                for mc in (1024, 2048):
                    build(
                        TK._select_kernel,
                        types,
                        dict(c, CB=128, MC=mc, PAIR_SMALL=TK.PAIR_SMALL, PAIR=TK.PAIR),
                        8,
                        f"topk select MC={mc} {tag}",
                        launch_pdl=pdl,
                        maxnreg=128,
                    )
        for pdl in (True, False):
            for has_len in (False, True):
                c = dict(HAS_LEN=has_len, HIST_MASK=TK.HIST_MASK, PDL=pdl, TRACE=pdl)
                tag = f"pdl={pdl} lengths={has_len}"
                lens = "*i64" if has_len else "*i32"
                a_types = dict(
                    x_ptr="*fp32", len_ptr=lens, st_ptr="*i32", mx_ptr="*i32", N="i32", HN="i32",
                    stride_x="i32", k="i32", C="i32", M="i32", R="i32", tr_ptr="*i64",
                )  # fmt: skip
                for s, rb in ((32, 64), (256, 8), (1024, 2)):
                    build(
                        TK._colmax_kernel, a_types, dict(c, S=s, RB=rb, MB=2048), 8,
                        f"topk colmax S={s} {tag}",
                    )  # fmt: skip
                g_types = dict(
                    x_ptr="*fp32", len_ptr=lens, st_ptr="*i32", cv_ptr="*fp32", ci_ptr="*i32",
                    N="i32", HN="i32", stride_x="i32", span="i32", k="i32", tr_ptr="*i64",
                )  # fmt: skip
                gc = dict(BLOCK=2048, CB=128, HAS_LEN=has_len, PDL=pdl, TRACE=pdl)
                build(TK._gather_kernel, g_types, gc, 8, f"topk gather {tag}", launch_pdl=pdl)
                f_types = dict(
                    len_ptr=lens, st_ptr="*i32", cv_ptr="*fp32", ci_ptr="*i32", val_ptr="*fp32",
                    idx_ptr="*i64", cnt_ptr="*i32", N="i32", HN="i32", k="i32", C="i32",
                    tr_ptr="*i64",
                )  # fmt: skip
                build(
                    TK._finish_kernel, f_types, dict(c, CB=128, MC=1024), 8,
                    f"topk finish {tag}", launch_pdl=pdl,
                )  # fmt: skip
        for kp, w in ((512, 4), (1024, 4), (2048, 8)):
            build(TK._sort_kernel, types, dict(KP=kp), w, f"topk sort KP={kp}")
        print(f"compile check for sm_{arch}: {'all ok' if not failures else f'{failures} FAILED'}")
        self.compile_failures = failures

    # -- report
    def report(self) -> str:
        out = []
        comp = [r for r in self.rows if r["kernel"] == "compress"]
        topk = [r for r in self.rows if r["kernel"] == "topk"]
        if comp:
            out += [
                "",
                "### Flash Compressor",
                "",
                "| variant | shape | µs | TB/s (min traffic) | × baseline | check | timing |",
                "|---|---|---:|---:|---:|---|---|",
            ]
            for r in comp:
                chk = r.get("check", "") + (f" ERROR {r['error']}" if r.get("error") else "")
                out.append(
                    f"| {r['variant']} | {r['shape']} | {_fmt(r.get('us'))} | "
                    f"{_fmt(r.get('tbps'), 2)} | {_fmt(r.get('speedup'), 1)} | {chk} | "
                    f"{r.get('timing', '')} |"
                )
        if topk:
            out += [
                "",
                "### Lightning TopK",
                "",
                "| variant | shape | µs | × torch.topk | check | timing |",
                "|---|---|---:|---:|---|---|",
            ]
            for r in topk:
                chk = r.get("check", "") + (f" ERROR {r['error']}" if r.get("error") else "")
                out.append(
                    f"| {r['variant']} | {r['shape']} | {_fmt(r.get('us'), 2)} | "
                    f"{_fmt(r.get('speedup'), 1)} | {chk} | {r.get('timing', '')} |"
                )
        if self.checks:
            out += ["", "### Extra top-k exactness checks", "", "| case | result |", "|---|---|"]
            out += [f"| {c['case']} | {c['result']} |" for c in self.checks]
        out += ["", "### Targets", ""] + [f"- {line}" for line in self.targets()]
        return "\n".join(out)

    def _find(self, variant_prefix, shape_prefix):
        for r in self.rows:
            if r["variant"].startswith(variant_prefix) and r["shape"].startswith(shape_prefix):
                return r
        return None

    def targets(self) -> list[str]:
        if self.smoke:
            return ["(smoke run: no targets)"]
        lines = []
        for name, shape in [("C4 overlap", "1,048,576x1024"), ("C128", "1,048,576x512")]:
            fl = [
                r
                for r in self.rows
                if r["variant"].startswith(f"{name}: flash")
                and "+norm" not in r["variant"]
                and r.get("us")
                and r["shape"].startswith(shape)
                and r.get("check", "").startswith("ok")
            ]
            if not fl:
                lines.append(f"compressor {name}: no passing flash variant")
                continue
            best = max(fl, key=lambda r: r["tbps"])
            ok = best["tbps"] >= 3.4 and (best.get("speedup") or 0) >= 10
            lines.append(
                f"compressor {name}: best {best['variant']} {best['tbps']:.2f} TB/s, "
                f"{_fmt(best.get('speedup'))}x naive -> target >=3.4 TB/s and >=10x: "
                f"{'MET' if ok else 'NOT MET'}"
            )
        for shape, us_max, x_min in [
            ("1x262,144 k=512", 15.0, 5.0),
            ("32x262,144 k=512", None, 2.0),
        ]:
            r = self._find("lightning (default)", shape)
            if not r or not r.get("us"):
                lines.append(f"topk {shape}: no result")
                continue
            ok = (us_max is None or r["us"] <= us_max) and (r.get("speedup") or 0) >= x_min
            ok = ok and r.get("check") == "exact"
            line = (
                f"topk {shape}: default call {r['us']:.2f} us, {_fmt(r.get('speedup'))}x "
                f"torch.topk, {r.get('check')} -> target "
                f"{f'<={us_max:g} us and ' if us_max else ''}>={x_min:g}x: "
                f"{'MET' if ok else 'NOT MET'}"
            )
            others = [
                o
                for o in self.rows
                if o["variant"].startswith("lightning")
                and o["variant"] != r["variant"]
                and o["shape"] == r["shape"]
                and o.get("us")
                and o.get("check") == "exact"
                and "sorted" not in o["variant"]
                and "lengths" not in o["variant"]
            ]
            if others:
                best = min(others, key=lambda o: o["us"])
                line += f" (best other variant: {best['variant']} {best['us']:.2f} us)"
            lines.append(line)
        return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, help="write every row and check to this file")
    p.add_argument("--budget", type=float, default=120.0, help="seconds before the sweeps stop")
    p.add_argument("--only", choices=["compress", "topk"])
    p.add_argument("--no-sweep", action="store_true", help="skip the launch-parameter sweeps")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    p.add_argument(
        "--compile-check",
        type=int,
        nargs="?",
        const=90,
        metavar="SM",
        help="no GPU needed: compile every kernel configuration for sm_SM (default 90)",
    )
    args = p.parse_args(argv)
    if args.compile_check:
        args.smoke = False
        bench = Bench.__new__(Bench)
        bench.compile_check(args.compile_check)
        return 1 if bench.compile_failures else 0
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or use --smoke to exercise the script on the CPU")
        return 2
    torch.manual_seed(SEED)
    bench = Bench(args)
    meta = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        seed=SEED,
        smoke=args.smoke,
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        print(f"triton is not importable ({_short(exc)}): nothing to benchmark")
        return 2
    if not args.smoke:
        props = torch.cuda.get_device_properties(0)
        meta.update(
            device=props.name,
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    bench.log(f"setup: {meta}")
    parts = [  # the target rows first
        ("compress", functools.partial(bench.compress, ["C4 overlap", "C128"])),
        ("topk", functools.partial(bench.topk, "targets")),
        ("compress", functools.partial(bench.compress, ["C4 no overlap"])),
        ("topk", functools.partial(bench.topk, "main")),
        ("compress", bench.compress_decode),
        ("topk", bench.topk_checks),
    ]
    if not args.no_sweep:
        parts += [
            ("compress", functools.partial(bench.compress, list(Bench.SHAPES), sweep=True)),
            ("topk", functools.partial(bench.topk, "sweep")),
        ]
    for name, part in parts:
        if args.only and args.only != name:
            continue
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - a broken part must not hide the others
            bench.add(
                dict(kernel=name, variant="(part aborted)", shape="-", us=None, error=_short(exc))
            )
            traceback.print_exc()
    meta["seconds"] = round(bench.budget.elapsed(), 1)
    report = bench.report()
    print(report)
    print(f"\n(total {meta['seconds']} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(dict(meta=meta, rows=bench.rows, checks=bench.checks), indent=1)
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
