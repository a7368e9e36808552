"""What a CUDA graph's launch costs on the host when its kernels read pinned host memory through
a mapped (zero-copy) view, by the size of that memory: HiSparse graph decode reads missed pages
from its host mirror this way (`adapters/memory/pinned_view.py`).

One tiny kernel (an ``index_select`` of 64 rows) is captured per variant and its graph replayed;
the host time of ``graph.replay()`` (the device synchronised between calls, so nothing queues)
and of the same kernel launched eagerly are reported, median over ``--iters``:

* ``device``: the rows in device memory (the control); ``device_pinned_alive``: the same while
  a pinned allocation of the size exists, unreferenced by the graph;
* ``pinned``: ``torch.empty(..., pin_memory=True)`` (``cudaHostAlloc``), mapped;
* ``registered``: anonymous ``mmap`` memory, 2 MiB aligned and advised for transparent huge
  pages, pinned by ``cudaHostRegister``, mapped.

    python bench/mapped_launch.py --sizes-mib 4 64 512 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapters.memory.pinned_view import mapped_view  # noqa: E402
from bench.meta import run_meta  # noqa: E402

HUGE = 2 << 20
WIDTH = 64  # int16 per row: 128-byte rows, like a small C4 entry


def registered(nbytes: int) -> tuple[torch.Tensor, object]:
    """Huge-page-advised anonymous memory pinned with ``cudaHostRegister`` (and its mmap)."""
    region = mmap.mmap(-1, nbytes + HUGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    skip = (-base) % HUGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
    host = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=skip)
    host.zero_()  # fault the pages in (huge where the kernel grants them)
    err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    return host.view(torch.int16).view(-1, WIDTH), region


def time_variant(rows: torch.Tensor, iters: int) -> dict[str, float]:
    dev = torch.device("cuda")
    n = rows.shape[0]
    idx = torch.randint(0, n, (64,), device=dev)
    out = torch.empty(64, WIDTH, dtype=rows.dtype, device=dev)

    def kernel() -> None:
        torch.index_select(rows, 0, idx, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernel()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel()
    result = {}
    for name, call in (("graph_replay_us", graph.replay), ("eager_launch_us", kernel)):
        times = []
        for _ in range(iters):
            torch.cuda.synchronize()
            t = time.perf_counter()
            call()
            times.append(1e6 * (time.perf_counter() - t))
        torch.cuda.synchronize()
        result[name] = round(statistics.median(times), 2)
    expect = rows[idx.cpu()] if rows.device.type == "cpu" else None
    if expect is not None and not torch.equal(out.cpu(), expect):
        raise SystemExit("the mapped view read wrong rows")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64, 512])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    rows_out = []
    for mib in args.sizes_mib:
        nbytes = mib << 20
        n = nbytes // (2 * WIDTH)
        dev_rows = torch.zeros(n, WIDTH, dtype=torch.int16, device="cuda")
        row = {"size_mib": mib, "device": time_variant(dev_rows, args.iters)}
        pinned = torch.zeros(n, WIDTH, dtype=torch.int16, pin_memory=True)
        row["device_pinned_alive"] = time_variant(dev_rows, args.iters)  # not referenced
        del dev_rows
        view = mapped_view(pinned, torch.device("cuda"))
        if view is None:
            raise SystemExit("mapping pinned memory failed")
        row["pinned"] = time_variant(view, args.iters)
        del view, pinned
        try:
            reg, region = registered(nbytes)
            view = mapped_view(reg, torch.device("cuda"))
            row["registered"] = (time_variant(view, args.iters) if view is not None
                                 else "mapping failed")  # fmt: skip
            del view
            torch.cuda.cudart().cudaHostUnregister(reg.data_ptr())
            del reg, region
        except (RuntimeError, ValueError, BufferError) as exc:
            row["registered"] = f"failed: {exc}"
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    out = dict(meta=run_meta(), args=vars(args), thp=thp.read_text().strip() if thp.exists()
               else None, rows=rows_out)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
