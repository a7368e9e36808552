"""Eager (outside CUDA graphs) cost of `adapters.kernels.topk` against `torch.topk`, one process.

Eager callers (prefill, HiSparse) pay the host's launch path on every call; a CUDA graph pays
none of it. Three ways side by side, on the same inputs:

* ``new``: `kernels.topk` as it is (launch plans cached per shape and flags, compiled kernels
  launched directly: `adapters.kernels.launch`);
* ``old``: the same with ``launch.CACHE_LAUNCHES = False`` (what ``ADAPTERS_LAUNCH_CACHE=0``
  sets): every call plans anew and launches through Triton's JIT, as before the cache;
* ``torch``: ``torch.topk(scores, k, sorted=...)`` over the whole rows (it takes no lengths).

For every shape: exactness first (new and old against `kernels.topk_reference`, bit for bit,
sorted or in index order; new equal to old; new on a side stream; new replayed from a CUDA
graph); then ``--rounds`` interleaved rounds of ``--calls`` back-to-back eager calls of each
way, ``torch.cuda.synchronize()`` only around each loop (the mean per call: what an eager caller
sees; the median round is reported, the fastest beside it); then each way's CUDA-graph time
(``--graph-calls`` calls captured once, the median of 10 replays).

    python bench/topk_eager.py --json OUT.json      # GPU
    python bench/topk_eager.py --smoke              # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before Triton is imported and the kernels are decorated
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import adapters.kernels as kernels  # noqa: E402
from adapters.kernels import launch  # noqa: E402
from bench.meta import run_meta  # noqa: E402

K = 512
TOPK = kernels.topk  # `_topk(smoke)`, set by `main`
CASES = [  # name, rows, row length, sorted, lengths ("full" none, "ragged" per-row)
    ("1x262144", 1, 262_144, False, "full"),
    ("1x262144 sorted", 1, 262_144, True, "full"),
    ("1x262144 lengths", 1, 262_144, False, "ragged"),
    ("1x262144 lengths sorted", 1, 262_144, True, "ragged"),
    ("32x262144", 32, 262_144, False, "full"),
    ("32x262144 lengths", 32, 262_144, False, "ragged"),
    ("2048x32768 lengths", 2048, 32_768, False, "ragged"),
    ("2048x32768 lengths sorted", 2048, 32_768, True, "ragged"),  # as ops.topk_lowest_index
]
SMOKE_CASES = [
    ("1x3000", 1, 3000, False, "full"),
    ("1x3000 lengths sorted", 1, 3000, True, "ragged"),
    ("8x1000 lengths", 8, 1000, False, "ragged"),
]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _topk(smoke: bool):
    """`kernels.topk`; for ``--smoke`` (CPU tensors, which `kernels.topk` sends to the
    reference) Lightning TopK itself, under the interpreter."""
    if not smoke:
        return kernels.topk
    import importlib

    return importlib.import_module("adapters.kernels.topk_lightning").lightning_topk


def _lengths(b: int, n: int, kind: str, device, g) -> torch.Tensor | None:
    """None, or per-row lengths: one row a little short; a batch drawn over [n/2, n]; prefill
    (many rows) causal, row i seeing ``(i + 1) * n / b`` entries (its first rows take all)."""
    if kind == "full":
        return None
    if b == 1:
        return torch.tensor([n - 1234], device=device)
    if b <= 64:
        return torch.randint(n // 2, n + 1, (b,), device=device, generator=g)
    return ((torch.arange(b, device=device) + 1) * (n // b)).clamp(max=n)


def _index_order(values, indices, counts):
    """Each row's real entries by index ascending (the reference's unsorted order)."""
    pos = torch.arange(values.shape[1], device=values.device)
    key = torch.where(pos < counts[:, None].long(), indices, torch.iinfo(torch.int64).max)
    order = torch.argsort(key, dim=1, stable=True)
    return values.gather(1, order), indices.gather(1, order), counts


def _same(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _way(name: str, x, lengths, sort: bool):
    """A no-argument call of one way, and whether the launch cache is on for it."""
    if name == "torch":
        return (lambda: torch.topk(x, K, dim=-1, sorted=sort)), True
    return (lambda: TOPK(x, K, lengths, sorted=sort)), name == "new"


@contextlib.contextmanager
def _cache(on: bool):
    """`launch.CACHE_LAUNCHES` as given for the duration (``old``: off), then on again."""
    launch.CACHE_LAUNCHES = on
    try:
        yield
    finally:
        launch.CACHE_LAUNCHES = True


def _run(fn, cached: bool):
    with _cache(cached):
        return fn()


def _checks(x, lengths, sort: bool, graph_calls: int) -> dict[str, bool]:
    want = kernels.topk_reference(x, K, lengths, sorted=sort)
    view = (lambda out: out) if sort else (lambda out: _index_order(*out))
    new = _run(lambda: TOPK(x, K, lengths, sorted=sort), True)
    old = _run(lambda: TOPK(x, K, lengths, sorted=sort), False)
    out = dict(new_exact=_same(view(new), want), old_exact=_same(view(old), want))
    out["new_equals_old"] = _same(new, old)
    if torch.cuda.is_available():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = TOPK(x, K, lengths, sorted=sort)
        torch.cuda.current_stream().wait_stream(side)
        out["new_side_stream_exact"] = _same(on_side, new)
        # captured on one input, replayed on another: the replay reads the new scores
        static = x.clone()
        graph, outs = _capture(lambda: TOPK(static, K, lengths, sorted=sort), graph_calls)
        static.copy_(x.flip(1))
        graph.replay()
        _sync()
        want = TOPK(static, K, lengths, sorted=sort)
        out["new_graph_exact"] = all(_same(o, want) for o in (outs[0], outs[-1]))
    return out


def _capture(fn, calls: int):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn() for _ in range(calls)]
    return graph, outs


def _eager_us(fn, calls: int) -> float:
    _sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    return (time.perf_counter() - t) / calls * 1e6


def _graph_us(fn, cached: bool, calls: int) -> float:
    with _cache(cached):
        graph, _ = _capture(fn, calls)
    graph.replay()
    _sync()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        _sync()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def bench_case(case, args, device, g) -> dict:
    name, b, n, sort, kind = case
    x = torch.randn(b, n, device=device, generator=g)
    lengths = _lengths(b, n, kind, device, g)
    row = dict(case=name, rows=b, n=n, k=K, sorted=sort, lengths=kind)
    row["checks"] = _checks(x, lengths, sort, args.graph_calls)
    ways = {w: _way(w, x, lengths, sort) for w in ("old", "new", "torch")}
    for fn, cached in ways.values():  # warm up: compile, plans, allocator
        for _ in range(5):
            _run(fn, cached)
    rounds: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(args.rounds):
        for w, (fn, cached) in ways.items():
            with _cache(cached):
                rounds[w].append(_eager_us(fn, args.calls))
    row["eager_us"] = {w: round(statistics.median(r), 2) for w, r in rounds.items()}
    row["eager_fastest_us"] = {w: round(min(r), 2) for w, r in rounds.items()}
    row["eager_rounds_us"] = {w: [round(t, 2) for t in r] for w, r in rounds.items()}
    if torch.cuda.is_available():
        row["graph_us"] = {
            w: round(_graph_us(fn, cached, args.graph_calls), 2) for w, (fn, cached) in ways.items()
        }
    return row


def _table(rows: list[dict]) -> str:
    lines = [
        "| case | eager old | eager new | eager torch.topk | new / torch | graph old | graph new "
        "| graph torch.topk | exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error']} |")
            continue
        e, gr = r["eager_us"], r.get("graph_us", {})
        exact = "yes" if all(r["checks"].values()) else f"NO {r['checks']}"
        lines.append(
            f"| {r['case']} | {e['old']:.1f} | {e['new']:.1f} | {e['torch']:.1f} | "
            f"{e['new'] / e['torch']:.2f} | {gr.get('old', float('nan')):.1f} | "
            f"{gr.get('new', float('nan')):.1f} | {gr.get('torch', float('nan')):.1f} | {exact} |"
        )
    return "\n".join(lines) + "\n(us per call; eager: median of rounds of back-to-back calls)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, help="write the meta and every row here (after each row)")
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per timed loop")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timed loops per way")
    p.add_argument("--graph-calls", type=int, default=20, help="calls captured per CUDA graph")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = p.parse_args(argv)
    if args.smoke:
        args.calls, args.rounds = 2, 1
    elif not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or use --smoke to exercise the script on the CPU")
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    global TOPK
    TOPK = _topk(args.smoke)
    out = dict(meta=dict(run_meta(), args=vars(args) | dict(json=str(args.json))), rows=[])
    print(json.dumps(out["meta"]), flush=True)
    g = torch.Generator(device).manual_seed(1234)
    for case in SMOKE_CASES if args.smoke else CASES:
        try:
            row = bench_case(case, args, device, g)
        except Exception as exc:  # noqa: BLE001 - one broken shape must not hide the others
            row = dict(case=case[0], error=f"{type(exc).__name__}: {exc}"[:300])
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=1))
    print(_table(out["rows"]))
    ok = all("error" not in r and all(r["checks"].values()) for r in out["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
