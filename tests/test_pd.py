"""PD disaggregation across two gloo processes (adapters/distributed/pd.py): a prefill engine
(rank 0) hands its cached prefix to a decode engine (rank 1) by page index; the decode engine's
greedy output through the normal `Runner` API equals a single engine's, in fp32 and fp64; a
receiver without room refuses with a typed message and the sender loses nothing; a sender that
dies before its bytes arrive leaves the receiver unchanged; the bytes that cross are the pages'
bytes (`bytes_per_token` of the pools, counted independently).

One spawned session runs every scenario (process start-up dominates the cost): both dtypes'
transfers and refusals, then the sender's death.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from small_models import SHORT

from shadowradix import CacheConfig

PAGE = 4
PROMPTS = [[(7 * i + 3) % 200 for i in range(61)], [(5 * i + 1) % 200 for i in range(40)]]
NEW_TOKENS = 6
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def cache_config(full_tokens: int = 2048) -> CacheConfig:
    return CacheConfig(page_size=PAGE, window=SHORT.window, compress_ratios=SHORT.compress_ratios,
                       full_capacity=full_tokens, swa_capacity=256, debug=True)  # fmt: skip


def runner(dtype: torch.dtype, full_tokens: int = 2048):
    from adapters.engine.runner import Runner

    return Runner(SHORT, cache_config(full_tokens), "cpu", dtype, chunk_tokens=32)


def greedy(r, prompt: list[int]) -> list[int]:
    from adapters.engine.sampling import SamplingParams

    (res,) = r.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS))
    return res.output


def page_bytes(r, full_pages: int, swa_pages: int) -> int:
    """The pages' bytes from the pools' per-token costs (not from pd_pools)."""
    from adapters.memory.pools import bytes_per_token

    per = bytes_per_token(r.model, r.cache.config, r.pools.dtype)
    return round(PAGE * (full_pages * per.per_cached_token + swa_pages * per.per_swa_token))


def _session(rank: int, port: int, out: str) -> None:  # runs in the spawned ranks
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))  # fmt: skip
    record = {}
    for scenario in ("ok", "dies"):  # the sender dies in the second: its record is written first
        record[scenario] = (_sender if rank == 0 else _receiver)(scenario)
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def _sender(scenario: str) -> dict:
    from adapters.distributed.pd import Need, Offer, _recv, _send, prefill, send_prefix
    from adapters.distributed.pd_pools import signature
    from shadowradix import export_layout

    out: dict = {}
    for name, dtype in DTYPES.items():
        r = runner(dtype)
        if scenario == "dies":  # offer, take the answer, die before any page byte
            prefill(r, PROMPTS[0])
            layout = export_layout(r.cache, PROMPTS[0], max_len=len(PROMPTS[0]) - 1)
            _send(Offer(tuple(PROMPTS[0]), layout, signature(r.pools)), 1, None)
            _recv(1, None, Need)
            os._exit(0)
        for i, prompt in enumerate(PROMPTS):
            first = prefill(r, prompt)
            rep = send_prefix(r, prompt, dst=1)
            out[f"{name}/{i}"] = dict(first=first, tokens=rep.num_tokens, bytes=rep.num_bytes,
                                      expected=rep.expected_bytes, full=rep.full_pages,
                                      swa=rep.swa_pages, own=page_bytes(r, rep.full_pages,
                                                                        rep.swa_pages))  # fmt: skip
        # the refusing receiver: nothing lost here, the prefix still serves locally
        rep = send_prefix(r, PROMPTS[0], dst=1)
        r.cache.check_invariants()
        hit = r.cache.match_prefix(PROMPTS[0], max_len=len(PROMPTS[0]) - 1).prefix_len
        out[f"{name}/refused"] = dict(reason=rep.refusal.reason.value if rep.refusal else None,
                                      hit=hit, local=greedy(r, PROMPTS[0]),
                                      pins=len(r.cache._pins))  # fmt: skip
    return out


def _receiver(scenario: str) -> dict:
    from adapters.distributed.pd import TransferAborted, receive_prefix
    from shadowradix.testing.snapshot import snapshot

    out: dict = {}
    for name, dtype in DTYPES.items():
        r = runner(dtype)
        if scenario == "dies":
            before = snapshot(r.cache)
            try:
                receive_prefix(r, src=0)
            except TransferAborted as exc:
                r.cache.check_invariants()
                return dict(aborted=str(exc)[:80], unchanged=snapshot(r.cache) == before,
                            output=greedy(r, PROMPTS[0]))  # fmt: skip
            return dict(aborted=None)
        for i in range(len(PROMPTS)):
            prompt, rep = receive_prefix(r, src=0)
            r.cache.check_invariants()
            hits0 = r.cache.stats().hit_tokens
            output = greedy(r, prompt)
            out[f"{name}/{i}"] = dict(output=output, tokens=rep.num_tokens, bytes=rep.num_bytes,
                                      hit=r.cache.stats().hit_tokens - hits0)  # fmt: skip
        small = runner(dtype, full_tokens=8 * PAGE)  # 8 virtual pages: the prompt needs 15
        before = snapshot(small.cache)
        _, rep = receive_prefix(small, src=0)
        out[f"{name}/refused"] = dict(reason=rep.refusal.reason.value if rep.refusal else None,
                                      unchanged=snapshot(small.cache) == before)  # fmt: skip
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[dict, dict]:
    """The two ranks' records of the session."""
    out = tmp_path_factory.mktemp("pd")
    mp.start_processes(_session, args=(_free_port(), str(out)), nprocs=2, start_method="spawn",
                       join=True)  # fmt: skip
    sender, receiver = (json.loads((out / f"rank{i}.json").read_text()) for i in range(2))
    return sender, receiver


@pytest.fixture(scope="module")
def single() -> dict[str, list[list[int]]]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {name: [greedy(runner(dtype), p) for p in PROMPTS] for name, dtype in DTYPES.items()}
    torch.set_num_threads(before)
    return out


def test_pd_output_equals_one_engine_and_bytes_are_the_pages(ranks, single):
    sender, receiver = ranks[0]["ok"], ranks[1]["ok"]
    for name in DTYPES:
        for i, prompt in enumerate(PROMPTS):
            s, r = sender[f"{name}/{i}"], receiver[f"{name}/{i}"]
            aligned = (len(prompt) - 1) // PAGE * PAGE
            assert s["tokens"] == r["tokens"] == aligned  # the whole reusable prefix moved
            assert r["hit"] == aligned  # and the decode engine's admission reused all of it
            assert r["output"] == single[name][i], (name, i)
            assert r["output"][0] == s["first"]  # the prefill engine's first token
            assert s["bytes"] == r["bytes"] == s["expected"] == s["own"] > 0
            assert s["full"] == aligned // PAGE and s["swa"] == SHORT.window // PAGE
        refused = sender[f"{name}/refused"]
        assert refused["reason"] == receiver[f"{name}/refused"]["reason"] == "no_room"
        assert receiver[f"{name}/refused"]["unchanged"]
        assert refused["pins"] == 0 and refused["hit"] == (len(PROMPTS[0]) - 1) // PAGE * PAGE
        assert refused["local"] == single[name][0]


def test_a_sender_dying_mid_transfer_leaves_the_receiver_clean(ranks, single):
    receiver = ranks[1]["dies"]
    assert receiver["aborted"], receiver
    assert receiver["unchanged"]
    assert receiver["output"] == single["fp32"][0]
