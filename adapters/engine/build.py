"""How `Runner(...)` is put together: the checks it makes of its arguments before it allocates
anything (the chunk against the SWA pool, tail-only prefill against the model, speculation
against the cache; each raises `ValueError` naming what cannot run; how modes combine is
`modes.check_modes`'s), and the execution side it builds (the HiSparse executor, the model
runner and its graph decoder or verifier)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from adapters.engine.chunks import max_pages_spanned
from adapters.engine.drafts import DraftContext, DraftSource, MTPDraft
from adapters.engine.forward import Forward
from adapters.engine.model_runner import ModelRunner
from adapters.engine.modes import Mode, Modes
from adapters.engine.speculative import SpeculativeDecoder
from adapters.forward.graph_decode import GraphDecoder
from adapters.forward.graph_verify import GraphVerifier
from adapters.memory.residency import GraphResidency
from adapters.model.model_config import ModelConfig
from shadowradix import CacheConfig, ShadowRadixCache

if TYPE_CHECKING:
    from adapters.memory.offload import C4Offload


def check_chunk(cache_config: CacheConfig, chunk_tokens: int, max_running: int) -> None:
    """A prefill chunk (and its window) the SWA pool can hold, and a batch of at least one."""
    if chunk_tokens < 1 or max_running < 1:
        raise ValueError("chunk_tokens and max_running must be >= 1")
    swa_need = chunk_tokens + cache_config.window + 2 * cache_config.page_size
    if swa_need > cache_config.swa_capacity:
        raise ValueError(
            f"SWA pool of {cache_config.swa_capacity} tokens cannot hold a {chunk_tokens}-token"
            f" chunk plus its window (needs {swa_need}); lower chunk_tokens"
        )


def check_tail_only(model: ModelConfig, tail_only: bool) -> bool:
    """``tail_only``, validated against the model (`ValueError` if it cannot apply)."""
    last = model.last_kv_source
    if tail_only and last is None:
        raise ValueError(
            "tail_only needs cross-layer KV sharing (ModelConfig.kv_sources): the layers after "
            "the last KV-source layer are the ones it skips"
        )
    if tail_only and last == model.num_layers - 1:
        raise ValueError(f"tail_only: no layer comes after the last KV-source layer {last}")
    return tail_only


def check_speculation(
    model: ModelConfig,
    cache_config: CacheConfig,
    num_tokens: int | None,
    draft: DraftSource | None,
) -> DraftSource | None:
    """The draft source of a speculative runner (`MTPDraft` by default), ``None`` without
    speculation; `ValueError` for a speculation the cache or the model cannot run (its
    combinations with other modes: `modes.check_modes`)."""
    if num_tokens is None:
        if draft is not None:
            raise ValueError("a draft source needs speculative_tokens=k")
        return None
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"speculative_tokens must be an int >= 1, got {num_tokens!r}")
    if not cache_config.speculative:
        raise ValueError("speculative decoding needs CacheConfig(speculative=True)")
    limit = cache_config.max_draft_len
    if limit is not None and num_tokens + 1 > limit:
        raise ValueError(
            f"speculative_tokens={num_tokens} verifies {num_tokens + 1} tokens per step, more "
            f"than the cache's max_draft_len={limit}"
        )
    verify_need = num_tokens + 1 + cache_config.window + 2 * cache_config.page_size
    if verify_need > cache_config.swa_capacity:
        raise ValueError(
            f"SWA pool of {cache_config.swa_capacity} tokens cannot hold a verify step of "
            f"{num_tokens + 1} tokens plus its window (needs {verify_need}); lower "
            "speculative_tokens"
        )
    if draft is None:
        if not model.mtp:
            raise ValueError("the model has no MTP layer: pass a draft source")
        draft = MTPDraft()
    return draft


def check_hisparse(
    model: ModelConfig, hisparse_pages: int | None, modes: Modes, page_size: int, max_running: int
) -> None:
    """A HiSparse buffer that holds one query's top-k pages plus the page it writes; with
    speculation run paged (no graph decode: the eager executor needs every page a step reads
    resident) one verify step's ``k + 1`` queries' pages plus the pages their tokens span; with
    overlap scheduling (whose batches are not cut to the buffer) a page for each running
    request. Graph steps read missing pages from the host mirror. Its combinations with other
    modes: `modes.check_modes`."""
    if hisparse_pages is None:
        return
    k = model.index_topk
    if hisparse_pages < k + 1:
        raise ValueError(
            f"hisparse_pages={hisparse_pages} cannot hold one query's top-{k} pages plus the "
            "page it writes"
        )
    t = 1 + modes.spec_tokens
    need = t * k + max_pages_spanned(t, page_size)
    if Mode.GRAPH_DECODE not in modes and t > 1 and hisparse_pages < need:
        raise ValueError(
            f"hisparse_pages={hisparse_pages} cannot hold a paged verify step's reads ({t} "
            f"queries x top-{k} pages, plus the pages {t} tokens span): pass at least {need}, "
            "or graph_decode=True (graph verify reads missing pages from the host mirror)"
        )
    if Mode.OVERLAP in modes and max_running > hisparse_pages:
        raise ValueError(
            f"overlap scheduling with HiSparse decodes up to max_running={max_running} requests "
            f"a step, each writing a page, more than hisparse_pages={hisparse_pages} hold: pass "
            "overlap=False or a larger buffer"
        )


def check_multi_stream(multi_stream: object) -> bool:
    """``multi_stream`` (the graph decoder's compressor and indexer on a side stream),
    validated: `TypeError` unless a bool (its combinations: `modes.check_modes`)."""
    if not isinstance(multi_stream, bool):
        raise TypeError(f"multi_stream must be a bool, got {multi_stream!r}")
    return multi_stream


def make_offload(
    cache: ShadowRadixCache,
    model: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    pages: int | None,
) -> C4Offload | None:
    """The HiSparse executor of ``pages`` device pages per C4 layer (None without HiSparse),
    following the cache's page events on its own queue (``take_events`` is untouched)."""
    if pages is None:
        return None
    from adapters.memory.offload import C4Offload

    events = cache.subscribe_events()
    return C4Offload(model, cache.config, device, dtype, pages, cache.config.debug, events=events)


def make_model_runner(
    paged: Forward,
    graph: bool,
    speculative: bool,
    max_batch: int,
    spec_tokens: int,
    multi_stream: bool = False,
) -> ModelRunner:
    """The model runner over ``paged``, with the graph decoder (``graph``, plain decode; with
    HiSparse its C4 KV through `GraphResidency`; ``multi_stream``: its attention prep on a
    side stream) or the graph verifier (``graph`` and ``speculative``: verify steps of
    ``spec_tokens + 1``, with HiSparse through a residency of ``max_batch * (spec_tokens + 1)``
    query rows)."""
    weights, pools, cc = paged.weights, paged.pools, paged.cache.config
    decoder = verifier = None
    rows = max_batch * (spec_tokens + 1 if speculative else 1)  # query rows of a graph step
    hisparse = None
    if graph and paged.offload is not None:  # HiSparse in the graph (`GraphResidency`)
        hisparse = GraphResidency(paged.offload, weights.config, rows)
    if graph and not speculative:
        decoder = GraphDecoder(
            weights, pools, cc, max_batch, cc.full_capacity, engram=paged.engram,
            hisparse=hisparse, multi_stream=multi_stream,
        )  # fmt: skip
    elif graph:
        verifier = GraphVerifier(
            weights, pools, cc, max_batch, cc.full_capacity, spec_tokens + 1, mtp=paged.mtp,
            hisparse=hisparse,
        )  # fmt: skip
    return ModelRunner(paged, decoder, verifier, paged.stats)


def make_speculation(
    model_runner: ModelRunner, draft: DraftSource | None, max_batch: int, spec_tokens: int
) -> SpeculativeDecoder | None:
    """The decode strategy of a speculative runner (None without a draft source): ``draft``
    bound to the model runner's weights and pools, drafting with CUDA graphs where verify
    steps run through the graph verifier on CUDA."""
    if draft is None:
        return None
    paged = model_runner.paged
    graphs = model_runner.verifier is not None and paged.device.type == "cuda"
    context = DraftContext(
        paged.weights, paged.pools, paged.cache.config, max_batch, spec_tokens, graphs
    )
    return SpeculativeDecoder(model_runner, spec_tokens, draft, context)
