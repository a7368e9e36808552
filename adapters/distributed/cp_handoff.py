"""A context-parallel prefill into a decode engine's pools (issue #16 item 2): the compressed
entries and indexer keys land at their global positions, the last window's latents and the
compressors' in-flight rows at the positions they belong to, and the engine's admission of the
prompt then reuses the whole page-aligned prefix, as after a PD transfer (`pd`).

The prefill is treated as a sender whose pages are the identity: virtual page ``p`` holds
positions ``[p·P, (p+1)·P)`` and their entries, SWA page ``j`` likewise. `handoff_range` says
which positions the prefill must keep per position (the window before the prefix end ``n``,
`cp_prefill(keep=...)`); `import_cp_prefill` builds a `PrefixLayout` of identity page ids, asks
the engine's cache what it lacks (`plan_import`: a typed `ImportRefused` changes nothing),
lays those pages' rows out as `pd_pools.gather_pages` would have, then imports and scatters
them (`pd_pools.scatter_pages`). The transfer layer never learns the layout of a DSv4 page:
the slot formulas (`shadowradix.slots`) place every row.

Handed off: window KV, compressed KV and indexer keys, in-flight rings, in the pools' own
dtype. Refused with `CPHandoffError`, before anything changes: quantised pool formats (their
scales come from the engine's write path), an MTP speculative engine's per-page hidden state,
tail-only's late-window bits, HiSparse (`pool_tensors` refuses it), and a prefill made for
another prefix end.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from adapters.distributed.cp import CPPrefill, token_digest
from adapters.distributed.pd_pools import PoolTensor, pool_tensors, scatter_pages, transfer_bytes
from adapters.engine.runner import Runner
from shadowradix import ImportReceipt, Pool, PrefixLayout, import_prefix, plan_import, slots
from shadowradix.config import CacheConfig
from shadowradix.transfer_layout import frozen_pages

_NAME = re.compile(r"(swa|kv_ring|index_ring|kv|index)(\d+)")


class CPHandoffError(ValueError):
    """A context-parallel prefill this engine's pools cannot take (nothing changed)."""


def handoff_range(num_tokens: int, config: CacheConfig) -> tuple[int, int]:
    """``(lo, n)``: the prefix a decode engine's admission of a ``num_tokens`` prompt reuses
    (``n``, page-aligned, at most ``num_tokens - 1``) and the first position whose window
    latents or in-flight rows its pools hold (the window's first page)."""
    p = config.page_size
    n = max(0, num_tokens - 1) // p * p
    return slots.window_first_page(n, config.window, p) * p, n


def _layout(tokens: list[int], config: CacheConfig, lo: int, n: int) -> PrefixLayout:
    p = config.page_size
    return PrefixLayout(
        tokens=frozen_pages(tokens[:n]),
        source_len=len(tokens),
        page_size=p,
        window=config.window,
        streams=config.streams,
        full_pages=frozen_pages(np.arange(n // p)),
        window_first_page=lo // p,
        swa_pages=frozen_pages(np.arange(lo // p, n // p)),
    )


def _check(
    runner: Runner, tokens: list[int], prefill: CPPrefill, lo: int, n: int
) -> list[PoolTensor]:
    try:
        tensors = pool_tensors(runner.pools)
    except ValueError as exc:  # HiSparse-offloaded C4 KV
        raise CPHandoffError(str(exc)) from exc
    if prefill.digest != token_digest(tokens):
        raise CPHandoffError("the prefill was made for another prompt than these tokens")
    if prefill.kept != (lo, n) or prefill.kept_rows is None:
        raise CPHandoffError(
            f"the prefill kept positions {prefill.kept}, the engine's prefix needs {(lo, n)}: "
            "pass cp_prefill(keep=handoff_range(len(tokens), cache_config))"
        )
    for t in tensors:
        if _NAME.fullmatch(t.name) is None:
            raise CPHandoffError(
                f"pool tensor {t.name!r} is not handed off by a context-parallel prefill "
                "(quantised formats, an MTP engine's page hidden states, tail-only's bits)"
            )
        if _source(prefill, t.name) is None:
            raise CPHandoffError(f"the prefill has no {t.name} rows: another model?")
    return tensors


def _source(prefill: CPPrefill, name: str) -> torch.Tensor | None:
    """The prefill's rows behind pool tensor ``name``: per position (window latents ``swa{i}``,
    rings ``*_ring{i}``) or per group (entries ``kv{i}``, indexer keys ``index{i}``)."""
    m = _NAME.fullmatch(name)
    assert m is not None and prefill.kept_rows is not None
    kind, layer = m.group(1), int(m.group(2))
    if kind == "swa" or kind.endswith("ring"):
        return prefill.kept_rows.get(name)
    return (prefill.entries if kind == "kv" else prefill.index_keys).get(layer)


def swa_positions(pages: np.ndarray, per_page: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, positions) of SWA pages ``pages`` (identity ids, renumbered to their order) of a
    tensor with ``per_page`` rows per page: the last ``per_page`` positions of each page, at
    ``ring_row`` (``per_page = P``: every position, the window latents' `page_slot`). A ring
    shorter than the page keeps only its page's last rows, as the engine does; each row is
    written once (a repeated index races on CUDA)."""
    k = np.repeat(np.arange(len(pages), dtype=np.int64), per_page)
    pos = np.repeat((np.asarray(pages, dtype=np.int64) + 1) * p, per_page) - np.tile(
        np.arange(per_page, 0, -1, dtype=np.int64), len(pages)
    )
    return slots.ring_row(k, pos, per_page), pos


def _swa_rows(kept: torch.Tensor, pages: np.ndarray, per_page: int, p: int, lo: int):
    out = kept.new_zeros((len(pages) * per_page, kept.shape[1]))
    rows, pos = swa_positions(pages, per_page, p)
    out[torch.from_numpy(rows).to(out.device)] = kept[torch.from_numpy(pos - lo).to(out.device)]
    return out


def _full_rows(entries: torch.Tensor, pages: np.ndarray, p: int, ratio: int, spp: int, n: int):
    """Rows of virtual pages ``pages`` (identity ids): each complete group's entry at
    ``compressed_slot`` of the page holding its last token, renumbered to the pages' order."""
    out = entries.new_zeros((len(pages) * spp, entries.shape[1]))
    local = np.full(max(1, n // p), -1, dtype=np.int64)
    local[np.asarray(pages, dtype=np.int64)] = np.arange(len(pages))
    groups = np.arange(n // ratio, dtype=np.int64)
    ends = slots.group_end(groups, ratio)
    at = local[ends // p]
    keep = at >= 0
    rows = slots.compressed_slot(at[keep], ends[keep], p, ratio, spp)
    dev = out.device
    out[torch.from_numpy(rows).to(dev)] = entries[torch.from_numpy(groups[keep]).to(dev)]
    return out


def _buffer(runner: Runner, tensors, prefill: CPPrefill, full, swa, lo: int, n: int):
    """`gather_pages`' buffer of those identity pages, built from the prefill."""
    cfg, model, parts = runner.cache.config, runner.model, []
    for t in tensors:
        src = _source(prefill, t.name)
        assert src is not None  # `_check`
        if t.pool is Pool.SWA:
            rows = _swa_rows(src, swa, t.rows_per_page, cfg.page_size, lo)
        else:
            m = _NAME.fullmatch(t.name)
            assert m is not None
            ratio = model.compress_ratios[int(m.group(2))]
            rows = _full_rows(src, full, cfg.page_size, ratio, t.rows_per_page, n)
        if tuple(rows.shape[1:]) != tuple(t.tensor.shape[1:]):
            raise CPHandoffError(f"{t.name}: prefill rows {tuple(rows.shape)}, pool rows of "
                                 f"{tuple(t.tensor.shape[1:])}: another model?")  # fmt: skip
        rows = rows.to(device=t.tensor.device, dtype=t.tensor.dtype).contiguous()
        parts.append(rows.view(torch.uint8).reshape(-1))
    if not parts:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.cat(parts)


def import_cp_prefill(runner: Runner, tokens: list[int], prefill: CPPrefill) -> ImportReceipt:
    """Writes ``prefill`` (a `cp_prefill` of ``tokens`` with ``keep=handoff_range(...)``) into
    ``runner``'s cache and pools: the prefix ``[0, n)`` is then cached, and ``runner``'s
    admission of ``tokens`` computes only the rest. Pages the cache already holds are not
    rewritten. Raises `CPHandoffError` or `ImportRefused` (no room), changing nothing."""
    lo, n = handoff_range(len(tokens), runner.cache.config)
    tensors = _check(runner, list(tokens), prefill, lo, n)
    layout = _layout(list(tokens), runner.cache.config, lo, n)
    plan = plan_import(runner.cache, list(tokens), layout)
    full = layout.full_pages[np.array(plan.full_index, dtype=np.int64)]
    swa = layout.swa_pages[np.array(plan.swa_index, dtype=np.int64)]
    buf = _buffer(runner, tensors, prefill, full, swa, lo, n)  # before the cache changes
    if buf.numel() != transfer_bytes(runner.pools, len(full), len(swa)):
        raise AssertionError("the handoff's buffer is not the pages' size")
    receipt = import_prefix(runner.cache, list(tokens), layout)
    if (receipt.full.index.tolist(), receipt.swa.index.tolist()) != (
        list(plan.full_index),
        list(plan.swa_index),
    ):  # single-threaded, nothing ran since the plan: unreachable
        raise AssertionError("the engine's cache changed between plan and import")
    scatter_pages(runner.pools, buf, receipt.full.dst, receipt.swa.dst)
    return receipt
