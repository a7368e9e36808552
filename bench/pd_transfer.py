"""PD transfer between two processes on one device: transfer GB/s and the decode engine's time
to first token after the transfer (#16 item 1).

Rank 0 is the prefill engine, rank 1 the decode engine, each a `Runner` with the same model and
pools, on the same device (``--device cuda`` puts both on GPU 0). They talk over gloo, so on a
GPU the page bytes are **staged through host memory**: the sender gathers the pages' rows on
the device and copies them to the host, gloo moves them between the processes, the receiver
copies them to the device and scatters them at its own page ids (`adapters.distributed.pd`).
CUDA IPC would skip both host copies; staging is what the same code does across hosts (with a
NIC in between), needs no shared CUDA context, and is what the CPU tests run.

For each of ``--reps`` prompts of ``--prompt-len`` random tokens (after one warm-up prompt):
prefill on rank 0, transfer, then on rank 1 the time of ``generate(prompt, 1 token)`` (the
prompt hits the imported prefix: TTFT after transfer) and, on a second receiver runner with an
empty cache, the same prompt cold (TTFT without PD, for scale). Figures per rep:

* ``bytes``: page bytes moved (= the pages' bytes, checked);
* ``transfer_s``: the receiver's offer → scatter done; ``bytes_s``: its receive + scatter;
  ``gbps = bytes / transfer_s / 1e9`` and ``bytes_gbps`` (the page bytes' leg alone);
  ``sender_s``: the sender's offer → ack (gather and D2H included);
* ``ttft_after_s``, ``ttft_cold_s``; ``match``: PD's first ``--new-tokens`` greedy tokens equal
  the cold runner's.

    python bench/pd_transfer.py --device cuda --prompt-len 32768 --reps 5 \
        --json bench/results/pd_transfer_h200.json
    python bench/pd_transfer.py --device cpu --model tiny --prompt-len 1024 --reps 2
    bench/launch/pd_nccl.sh        # two GPUs, NCCL, device-to-device bytes (torchrun)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from bench.meta import run_meta  # noqa: E402


def build(args) -> Runner:
    model = preset(args.model)
    p = args.page_size
    tokens = 2 * (args.prompt_len + args.new_tokens + 4 * p) * (args.reps + 1)
    cache = model.cache_config(
        page_size=p,
        full_capacity=-(-tokens // p) * p,
        swa_capacity=8 * p + args.chunk_tokens + model.window,
    )
    dtype = getattr(torch, args.dtype)
    return Runner(model, cache, device=args.device, dtype=dtype, chunk_tokens=args.chunk_tokens)


def prompts(args) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    vocab = preset(args.model).vocab_size
    return [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.reps + 1)]


def timed_generate(runner: Runner, prompt: list[int], n: int) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    (res,) = runner.generate([prompt], SamplingParams(max_new_tokens=n))
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return res.output, time.perf_counter() - t0


def rank_main(rank: int, port: int, args, out: str) -> None:  # runs in the spawned ranks
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=600))  # fmt: skip
    run_rank(rank, args, out)
    dist.destroy_process_group()


def run_rank(rank: int, args, out: str) -> None:
    """One engine's side of every rep; its rows go to ``out/rank{rank}.json``."""
    from adapters.distributed.pd import prefill, receive_prefix, send_prefix

    runner, rows = build(args), []
    cold = build(args) if rank == 1 else None
    for i, prompt in enumerate(prompts(args)):
        if rank == 0:
            first = prefill(runner, prompt)
            rep = send_prefix(runner, prompt, dst=1)
            rows.append(dict(first=first, sender_s=rep.seconds, expected=rep.expected_bytes))
            continue
        assert cold is not None
        prompt, rep = receive_prefix(runner, src=0)
        _, ttft = timed_generate(runner, prompt, 1)
        pd_out, _ = timed_generate(runner, prompt, args.new_tokens)
        _, ttft_cold = timed_generate(cold, prompt, 1)
        cold_out, _ = timed_generate(cold, prompt, args.new_tokens)
        rows.append(dict(warmup=i == 0, tokens=rep.num_tokens, bytes=rep.num_bytes,
                         full_pages=rep.full_pages, swa_pages=rep.swa_pages,
                         transfer_s=rep.seconds, bytes_s=rep.bytes_seconds,
                         gbps=rep.num_bytes / rep.seconds / 1e9,
                         bytes_gbps=rep.num_bytes / max(rep.bytes_seconds, 1e-12) / 1e9,
                         ttft_after_s=ttft, ttft_cold_s=ttft_cold,
                         match=pd_out == cold_out))  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))


def torchrun_rank(args) -> int:
    """Runs this torchrun rank (NCCL on ``cuda:LOCAL_RANK``, or the backend torchrun's
    ``--backend`` names); both ranks have written their rows when it returns."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"
    dist.init_process_group(args.backend, timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    run_rank(rank, args, args.rows_dir)
    dist.barrier()
    dist.destroy_process_group()
    return rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flash-shaped")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="nccl", help="torchrun mode only (spawned: gloo)")
    ap.add_argument("--json", help="write {meta, config, rows, summary} here")
    ap.add_argument("--rows-dir", help="torchrun: where the ranks leave their rows (shared)")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    meta = run_meta()
    if "RANK" in os.environ:  # launched by torchrun (bench/launch/pd_nccl.sh): one rank here
        rank = torchrun_rank(args)
        if rank != 0:
            return 0
        rows_dir = args.rows_dir
    else:
        tmp = tempfile.mkdtemp()
        mp.start_processes(rank_main, args=(free_port(), args, tmp), nprocs=2,
                           start_method="spawn", join=True)  # fmt: skip
        rows_dir = tmp
    sender, receiver = (json.loads(Path(rows_dir, f"rank{i}.json").read_text()) for i in (0, 1))
    for s, r in zip(sender, receiver):
        r.update(sender_s=s["sender_s"], bytes_ok=s["expected"] == r["bytes"])
    timed = [r for r in receiver if not r["warmup"]]
    keys = ("gbps", "bytes_gbps", "transfer_s", "ttft_after_s", "ttft_cold_s")
    summary: dict[str, object] = {k: statistics.median(r[k] for r in timed) for k in keys}
    summary.update(bytes=timed[0]["bytes"], tokens=timed[0]["tokens"],
                   all_match=all(r["match"] for r in receiver),
                   bytes_ok=all(r["bytes_ok"] for r in receiver),
                   staging="NCCL, device to device" if "RANK" in os.environ and
                   args.backend == "nccl" else "gloo through host memory")  # fmt: skip
    out = dict(meta=meta, config=vars(args), rows=receiver, summary=summary)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if summary["bytes_ok"] else 1  # bf16 greedy may flip a near tie: match is reported


if __name__ == "__main__":
    sys.exit(main())
