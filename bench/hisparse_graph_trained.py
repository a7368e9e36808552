"""HiSparse in CUDA graphs on real attention: the trained ``tiny-trained`` model decoding real
text (KJV), all-resident graph decode against graph decode with the C4 KV in HiSparse's host
mirror and a device buffer of ``--buffer-fraction`` of the C4 pages (docs/hisparse.md).

``--batch`` documents of ``--context`` bytes (``--split``: ``heldout`` or ``train``; the
training split only for lengths the held-out split cannot give: the model has seen it, which
matters for its loss, not for where its indexer looks) are prefilled through the runner, then
``--steps`` decode steps are timed with every request decoding (each generates enough tokens
to outlast the other requests' prefills and the timed steps: `max_new`; the rows record the
mean and least batch of the timed steps), each end to end (the step call, with HiSparse's commit and
table sync), overlap scheduling off in both arms. One HiSparse arm per ``--commit-every``
value (graph steps per planning window). Reports the median and the mean ms per step, the
ratio over the *mean* (target >= 0.95: a window's commit lands in one of its steps, which a
median would hide; with ``--repeat`` the median over interleaved repetitions of the ratio to the
same repetition's all-resident arm), the timed steps' `GraphStats` and whether the greedy
tokens are equal. ``--speculative K``: every decode step is a graph verify step of ``K + 1``
tokens (the model's MTP draft), HiSparse through the verifier's residency; the rows then
add the tokens emitted per second and the acceptance rate.

    python bench/hisparse_graph_trained.py --device cuda --context 32768 --batch 8 --steps 32
    python bench/hisparse_graph_trained.py --device cpu --context 2048 --batch 2 --steps 4
    python bench/hisparse_graph_trained.py --device cuda --context 16384 --speculative 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.memory.device import resolve_device  # noqa: E402
from adapters.memory.residency import COMMIT_EVERY  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.tokenizer import BOS  # noqa: E402
from adapters.model.weights_file import file_sha256, load_shipped, load_weights  # noqa: E402
from adapters.training.corpus import load_split  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from bench.quality import default_data  # noqa: E402


def documents(args: argparse.Namespace) -> list[list[int]]:
    split = load_split(Path(args.data), verify=False)
    text = split.heldout if args.split == "heldout" else split.train
    if args.batch * args.context > len(text):
        raise SystemExit(f"{args.batch} x {args.context} bytes: the {args.split} split has "
                         f"{len(text)}; use --split train or shorter --context")  # fmt: skip
    return [[BOS, *text[k * args.context : (k + 1) * args.context]] for k in range(args.batch)]


def make_runner(model, weights, args, buffer: int | None, every: int | None) -> Runner:  # type: ignore[no-untyped-def]
    p = args.page_size
    sized = max(args.context, args.pool_context or 0)  # bytes per document the pools hold
    decoded = args.max_new + 8
    full = -(-(args.batch * (sized + decoded) + 4 * args.chunk) // p) * p
    spec = args.speculative or None
    cc = model.cache_config(page_size=p, full_capacity=full, swa_capacity=full,
                            speculative=spec is not None)  # fmt: skip
    runner = Runner(model, cc, device=weights.device, dtype=weights.dtype, weights=weights,
                    chunk_tokens=args.chunk, max_running=args.batch, graph_decode=True,
                    overlap=False, hisparse_pages=buffer, speculative_tokens=spec)  # fmt: skip
    if every is not None:
        residency(runner).commit_every = every  # type: ignore[union-attr]
    return runner


def residency(runner: Runner):  # type: ignore[no-untyped-def]
    """The graph step's `GraphResidency` (the decoder's, or the verifier's under
    ``--speculative``), None when every page is resident."""
    return runner.model_runner.graph_hisparse


def max_new(args: argparse.Namespace, docs: list[list[int]]) -> int:
    """Tokens each request generates: enough that none finishes before the timed steps end.
    Every step also decodes the requests whose prefill ended (continuous batching), so the
    first of them decodes through the other prefills: at most one step per ``--chunk`` of the
    batch's prompts plus one per request, then the warm-up and timed steps."""
    prefill_steps = sum(len(d) for d in docs) // args.chunk + len(docs) + 1
    steps = prefill_steps + args.warmup + args.steps + args.profile_steps
    return steps * (1 + args.speculative) + 1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_arm(runner: Runner, docs: list[list[int]], args) -> dict:  # type: ignore[no-untyped-def]
    ids = [runner.submit(d, SamplingParams(max_new_tokens=args.max_new)) for d in docs]
    t0, done = time.perf_counter(), []
    while runner.num_prefilling:
        done += runner.step()
    prefill_s = time.perf_counter() - t0
    for _ in range(args.warmup):  # graph capture of the batch / context bucket
        done += runner.step()
    hs = residency(runner)
    emitted0 = 0 if runner.spec is None else runner.spec.stats.emitted_tokens
    accepted0 = (0, 0) if runner.spec is None else (runner.spec.stats.accepted_tokens,
                                                    runner.spec.stats.drafted_tokens)  # fmt: skip
    before = None if hs is None else dict(vars(hs.stats))
    hit0 = None if hs is None else hs.hit_rate()
    phases = phase_timers(runner) if args.phases else None
    times: list[float] = []
    batches: list[int] = []  # requests decoding in each timed step
    while runner.num_pending and len(times) < args.steps:
        batches.append(len(runner.budget.decode_rows()))
        sync(runner.device)
        t = time.perf_counter()
        done += runner.step()
        sync(runner.device)
        times.append(time.perf_counter() - t)
    hit1 = None if hs is None else hs.hit_rate()
    spec = None
    if runner.spec is not None:
        st = runner.spec.stats
        accepted, drafted = st.accepted_tokens - accepted0[0], st.drafted_tokens - accepted0[1]
        spec = dict(emitted_tokens=st.emitted_tokens - emitted0,
                    tokens_per_s=(st.emitted_tokens - emitted0) / sum(times),
                    acceptance_rate=round(accepted / max(drafted, 1), 4))  # fmt: skip
    if phases is not None:
        row_phases = {k: round(statistics.median(v), 4) for k, v in phases.items() if v}
        print(f"## phases, median ms per call: {row_phases}", flush=True)
    if args.probe and runner.device.type == "cuda":
        row_probe = probe(runner, args.probe)
        print(f"## probe: {row_probe}", flush=True)
    if args.profile_steps:
        done += profile_steps(runner, args.profile_steps)
    while runner.num_pending:
        done += runner.step()
    failed = [r for r in done if r.error is not None]
    if failed or not times:
        raise SystemExit(f"{len(failed)} requests failed, {len(times)} steps timed: "
                         f"{failed[0].error if failed else 'none decoded'}")  # fmt: skip
    by_id = {r.request_id: r.output for r in done}
    row = dict(prefill_s=round(prefill_s, 3), step_ms=1e3 * statistics.median(times),
               mean_step_ms=1e3 * statistics.fmean(times), steps=len(times),
               mean_batch=statistics.fmean(batches), min_batch=min(batches),
               outputs=[by_id[i] for i in ids])  # fmt: skip
    if phases is not None:
        row["phases_ms"] = row_phases
    if spec is not None:
        row["speculative"] = spec
    if args.probe and runner.device.type == "cuda":
        row["probe"] = row_probe
    if hs is not None and before is not None:
        row["graph_stats"] = {k: v - before[k] for k, v in vars(hs.stats).items()}
    if hit0 is not None and hit1 is not None:  # entries read from the buffer / entries read
        hit, read = hit1[0] - hit0[0], hit1[1] - hit0[1]
        row["entries_read"], row["entry_hit_rate"] = read, round(hit / max(read, 1), 4)
    return row


def phase_timers(runner: Runner) -> dict[str, list[float]]:
    """Wraps the graph decoder's step phases with host timers (ms per call), and its replay
    with CUDA events (``replay_gpu``: the device time of the captured step, read after each
    step's synchronisation)."""
    dec = runner.decoder
    assert dec is not None
    times: dict[str, list[float]] = {}
    import adapters.forward.graph_decode as graph_decode
    import adapters.memory.block_tables as block_tables

    targets = [(dec, "step"), (dec, "_replay"), (dec.buffers, "load"),
               (dec.buffers.tables, "apply"), (dec.buffers.tables, "place"),
               (block_tables, "upload"), (graph_decode, "upload")]  # fmt: skip
    if dec.hisparse is not None:
        targets += [(dec.hisparse, n) for n in ("before_step", "after_launch", "after_step")]
    for obj, name in targets:
        fn, into = getattr(obj, name), times.setdefault(name, [])

        if name == "upload":
            into = times.setdefault(f"upload ({obj.__name__.rsplit('.', 1)[-1]})", [])

        def timed(*a, _fn=fn, _into=into, **k):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = _fn(*a, **k)
            _into.append(1e3 * (time.perf_counter() - t0))
            return out

        setattr(obj, name, timed)
    if runner.device.type == "cuda":  # the device's backlog when the step's load begins
        load, wait = dec.buffers.load, times.setdefault("device_backlog_at_load", [])

        def load_after_sync(*a, **k):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            torch.cuda.synchronize()
            wait.append(1e3 * (time.perf_counter() - t0))
            return load(*a, **k)

        dec.buffers.load = load_after_sync  # type: ignore[method-assign]
    if runner.device.type == "cuda":
        replay, gpu = dec._replay, times.setdefault("replay_gpu", [])
        pending: list = []

        def replay_timed(*a, **k):  # type: ignore[no-untyped-def]
            if pending:  # the last step's: synchronised by now
                gpu.append(pending[0].elapsed_time(pending[1]))
                pending.clear()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = replay(*a, **k)
            end.record()
            pending.extend((start, end))
            return out

        dec._replay = replay_timed  # type: ignore[method-assign]
    return times


def probe(runner: Runner, n: int) -> dict[str, float]:
    """The last step's graph replayed alone ``n`` times (the device idle before each): the
    launch's host time and the replay's wall time, median us; and a fixed host-only workload
    (NumPy and Python, no device), median us: is the host itself slower in this arm?"""
    import numpy as np

    graphs = runner.decoder.graphs._graphs  # type: ignore[union-attr]
    graph, _ = graphs[max(graphs, key=lambda key: (key[1], key[0]))]
    launch, wall, host = [], [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        launch.append(1e6 * (t1 - t0))
        wall.append(1e6 * (t2 - t0))
        t3 = time.perf_counter()
        for _ in range(50):
            np.flatnonzero(np.arange(256) % 3 == 0).sum()
            sorted(range(64), key=lambda v: -v)
        host.append(1e6 * (time.perf_counter() - t3))
    med = statistics.median
    return dict(launch_us=round(med(launch), 1), replay_wall_us=round(med(wall), 1),
                host_workload_us=round(med(host), 1))  # fmt: skip


def profile_steps(runner: Runner, steps: int) -> list:
    """``steps`` decode steps under torch.profiler (host and device) and cProfile: prints the
    top device ops, the device busy time per step, and the top host functions."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    done: list = []
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda"
                                     else [])  # fmt: skip
    prof, host = profile(activities=acts), cProfile.Profile()
    sync(runner.device)
    t0 = time.perf_counter()
    with prof:
        host.enable()
        for _ in range(steps):
            done += runner.step()
        sync(runner.device)
        host.disable()
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / steps / 1e3
    print(f"## profile: {steps} steps, {1e3 * wall:.3f} ms/step wall (profiled), device busy "
          f"{busy:.3f} ms/step (sum of kernel times)")  # fmt: skip
    print(events.table(sort_by="self_device_time_total", row_limit=15))
    print_gaps(prof, steps)
    out = io.StringIO()
    pstats.Stats(host, stream=out).sort_stats("cumulative").print_stats(30)
    print(out.getvalue())
    return done


def print_gaps(prof, steps: int) -> None:  # type: ignore[no-untyped-def]
    """From the profiled trace: the device's idle time between consecutive kernels per step,
    the largest gaps (with the kernels either side), and the host time of each graph launch."""
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(path)
    trace = json.loads(Path(path).read_text())["traceEvents"]
    os.unlink(path)
    kernels = sorted((e for e in trace if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    gaps = [(b["ts"] - (a["ts"] + a["dur"]), a["name"][:40], b["name"][:40])
            for a, b in zip(kernels, kernels[1:])]  # fmt: skip
    inner = [g for g in gaps if 0 < g[0] < 200]  # (not the host's time between steps)
    launch = [e["dur"] for e in trace if e.get("name") == "cudaGraphLaunch"]
    print(f"## gaps: {len(kernels) / steps:.0f} kernels/step, idle between kernels "
          f"{sum(g[0] for g in inner) / steps:.1f} us/step in gaps < 200 us; cudaGraphLaunch "
          f"host us: {sorted(launch)}")  # fmt: skip
    for gap, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"##   {gap:8.1f} us after {before} before {after}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data", default=str(default_data()))
    ap.add_argument("--split", choices=("heldout", "train"), default="heldout")
    ap.add_argument("--context", type=int, default=16384, help="bytes per document")
    ap.add_argument("--pool-context", type=int, default=0,
                    help="size the pools for documents of this many bytes (default: --context)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--buffer-fraction", type=float, default=0.2)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096, help="prefill tokens per step")
    ap.add_argument("--commit-every", type=int, nargs="+", default=[COMMIT_EVERY],
                    help="graph steps per HiSparse planning window; one arm per value")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every arm, interleaved; the ratio is the median paired one")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the timed steps, this many under torch.profiler + cProfile")
    ap.add_argument("--phases", action="store_true",
                    help="time the graph step's phases (host timers, CUDA events on the replay)")
    ap.add_argument("--probe", type=int, default=0,
                    help="after the timed steps, replay the last graph alone this many times")
    ap.add_argument("--hisparse-first", action="store_true",
                    help="run the HiSparse arms before the all-resident one (order effects)")
    ap.add_argument("--weights", help="a weights file (python -m adapters.train --out): its own "
                    "model; default the shipped tiny-trained")  # fmt: skip
    ap.add_argument("--speculative", type=int, default=0,
                    help="K: decode by graph verify steps of K + 1 tokens (MTP)")  # fmt: skip
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.speculative and (args.phases or args.probe or args.profile_steps):
        ap.error("--phases, --probe and --profile-steps time the graph decoder: not with "
                 "--speculative")  # fmt: skip
    meta = run_meta()
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.weights:
        weights = load_weights(args.weights, None, device, dtype)
        model = weights.config
        sha = file_sha256(args.weights)
        about = f"{model.name}, trained weights {args.weights} (SHA-256 {sha})"
    else:
        model = preset("tiny-trained")
        weights = load_shipped(model, device, dtype)
        about = "tiny-trained (trained weights, real text)"
    docs = documents(args)
    args.max_new = max_new(args, docs)
    pages = sum(-(-len(d) // args.page_size) for d in docs)  # C4 pages the batch holds
    buffer = max(model.index_topk + 2, int(args.buffer_fraction * pages))
    arms: dict[str, tuple[int | None, int | None]] = {"resident": (None, None)}
    arms.update({f"hisparse_every_{n}": (buffer, n) for n in args.commit_every})
    if args.hisparse_first:
        arms = dict(reversed(list(arms.items())))
    reps: list[dict[str, dict]] = []
    for rep in range(args.repeat):  # the arms interleaved, a fresh runner each
        reps.append({})
        for name, (b, every) in arms.items():
            reps[-1][name] = run_arm(make_runner(model, weights, args, b, every), docs, args)
            print(f"# rep {rep}: {name}: {reps[-1][name]['mean_step_ms']:.3f} ms/step (mean)",
                  flush=True)  # fmt: skip
    rows = {}
    reference = reps[0]["resident"]["outputs"]
    for name in arms:
        runs = [r[name] for r in reps]
        row = dict(runs[0])
        for key in ("step_ms", "mean_step_ms", "prefill_s"):
            row[key] = statistics.median(run[key] for run in runs)
        row["reps_mean_step_ms"] = [run["mean_step_ms"] for run in runs]
        equal = [a == b for run in runs for a, b in zip(reference, run.pop("outputs"))]
        row.pop("outputs")
        if name != "resident":  # paired with the resident arm of its repetition
            pairs = [r["resident"]["mean_step_ms"] / r[name]["mean_step_ms"] for r in reps]
            row["ratio"], row["reps_ratio"] = statistics.median(pairs), pairs
            if args.speculative:  # a step's tokens differ when HiSparse runs fewer requests
                tok = [r[name]["speculative"]["tokens_per_s"]
                       / r["resident"]["speculative"]["tokens_per_s"] for r in reps]  # fmt: skip
                row["tokens_ratio"], row["reps_tokens_ratio"] = statistics.median(tok), tok
            row["equal_share"] = sum(equal) / len(equal)
        rows[name] = row
    res = rows["resident"]
    hsp = rows[f"hisparse_every_{args.commit_every[0]}"]
    ratio = hsp["ratio"]
    out = dict(meta=meta, args=vars(args), model=about,
               dtype=str(dtype), c4_pages=pages, buffer_pages=buffer, resident=res,
               hisparse=hsp, arms=rows, ratio=ratio, ratio_basis="mean step time",
               target=0.95, met=ratio >= 0.95, equal_share=hsp["equal_share"])  # fmt: skip
    print(
        f"# {about}, {dtype}, {device}: {args.batch} x {args.context} bytes of "
        f"{args.split} text, buffer {buffer} of {pages} pages ({buffer / pages:.0%})"
    )
    for name, r in rows.items():
        print(
            f"{name:18s} median {r['step_ms']:7.3f} mean {r['mean_step_ms']:7.3f} ms/step  "
            f"prefill {r['prefill_s']:.1f} s  batch {r['mean_batch']:.2f} (min {r['min_batch']})  "
            f"ratio {r.get('ratio', 1.0):.3f}  "
            f"equal {r.get('equal_share', 1.0):.2f}  tokens/s ratio {r.get('tokens_ratio', '-')}  "
            f"{r.get('graph_stats', '')}  "
            f"entry hits {r.get('entry_hit_rate', '-')} of {r.get('entries_read', '-')}"
            f"  {r.get('speculative', '')}"
        )
    verdict = "met" if ratio >= 0.95 else "NOT met"
    print(
        f"HiSparse (commit every {args.commit_every[0]}) / resident: {ratio:.3f}x over the mean "
        f"(target >= 0.95: {verdict}); greedy tokens equal in {hsp['equal_share']:.0%}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
