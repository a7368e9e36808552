"""Lightning TopK (bound algorithm, the prefill tile shapes) equals its reference on the GPU."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from adapters import kernels  # noqa: E402

ok = True
for b, n in (
    (4096, 1024),
    (8192, 2048),
    (8192, 4096),
    (8192, 16384),
    (4096, 34816),
    (1024, 262144),
):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.relu(torch.randn(b, n, device="cuda", generator=g))  # ties at 0, as the indexer's
    lens = torch.randint(0, n + 1, (b,), device="cuda", generator=g)
    x = torch.where(torch.arange(n, device="cuda")[None] < lens[:, None], x, float("-inf"))
    got = kernels.topk(x, 512, lens, sorted=True)
    want = kernels.topk_reference(x, 512, lens, sorted=True)
    same = all(torch.equal(a, c) for a, c in zip(got, want))
    ok &= same
    print(f"topk {b} x {n}: {'ok' if same else 'MISMATCH'}", flush=True)
sys.exit(0 if ok else 1)
