"""The ``shadowradix`` flag values that `CacheConfig` or the `Runner` would refuse, checked
before anything is built so that the one-line error names the flag the user typed
(``--chunk-tokens``), not the API argument it becomes (``chunk_tokens``). The cache and the
runner keep their own checks; `in_flag_terms` re-words what still gets through (a pool sized
from ``--pool-budget-gib``, a refused prompt's reason)."""

from __future__ import annotations

import re

from adapters.engine.chunks import max_pages_spanned
from shadowradix import CacheConfig


class FlagError(ValueError):
    """A flag value that cannot run; the message starts with the flag as typed."""


def shape_config(factory, page_size: int, window: int, **kwargs: object) -> CacheConfig:  # type: ignore[no-untyped-def]
    """A `CacheConfig` from ``factory`` (`CacheConfig` or `ModelConfig.cache_config`, whose
    window is ``window``) with ``page_size`` and pools just large enough to be valid: for what
    depends on the page and the window only (``window_pages``, ``max_draft_len``)."""
    return factory(  # type: ignore[no-any-return]
        page_size=page_size,
        full_capacity=page_size,
        swa_capacity=page_size * (window + 2),
        **kwargs,
    )


def check_device(text: str) -> None:
    """``--device``: ``auto``, ``cpu`` (``cpu:0``), or a CUDA GPU this machine has; the error
    lists the usable ones."""
    import torch  # here, not above: ``demo`` never needs torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    usable = ["auto", "cpu"] + (["cuda"] + [f"cuda:{i}" for i in range(gpus)] if gpus else [])
    if text == "auto":
        return
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        device = None
    ok = device is not None and (
        (device.type == "cpu" and device.index in (None, 0))
        or (device.type == "cuda" and (device.index or 0) < gpus)
    )
    if not ok:
        why = "" if gpus or not text.startswith("cuda") else ", no CUDA GPU is available"
        raise FlagError(f"--device {text!r}: not a usable device here{why} (usable: "
                        f"{', '.join(usable)})")  # fmt: skip


def check_pools(shape: CacheConfig, full_tokens: int, swa_tokens: int) -> None:
    """``--full-tokens`` / ``--swa-tokens``: whole pages of ``--page-size``, and an SWA pool
    that holds one request's window (``shape``: the page size and window they go with)."""
    p = shape.page_size
    for flag, tokens in (("--full-tokens", full_tokens), ("--swa-tokens", swa_tokens)):
        if tokens % p:
            raise FlagError(
                f"{flag} {tokens}: not a whole number of pages (a multiple of --page-size {p})"
            )
    least = (shape.window_pages + 1) * p
    if swa_tokens < least:
        raise FlagError(
            f"--swa-tokens {swa_tokens}: one request's window needs {least // p} pages of "
            f"{p} tokens: at least {least}"
        )


def check_chunk(cache: CacheConfig, chunk_tokens: int) -> None:
    """``--chunk-tokens``: a prefill chunk plus its window fits the SWA pool."""
    need = chunk_tokens + cache.window + 2 * cache.page_size
    if need > cache.swa_capacity:
        raise FlagError(
            f"--chunk-tokens {chunk_tokens}: a chunk plus its window needs {need} SWA tokens, "
            f"more than --swa-tokens {cache.swa_capacity}: lower --chunk-tokens or raise "
            "--swa-tokens"
        )


def check_speculative(shape: CacheConfig, draft_tokens: int | None, bounded_replay: bool) -> None:
    """``--speculative K``: not with ``--bounded-replay``, and ``K + 1`` verified tokens within
    the rings of ``shape`` (a speculative config of the run's page size and model)."""
    if draft_tokens is None:
        return
    if bounded_replay:
        raise FlagError(
            "--bounded-replay cannot be combined with --speculative (encoder-side replay is "
            "incompatible with speculative decoding)"
        )
    limit = shape.max_draft_len
    if limit is not None and draft_tokens + 1 > limit:
        raise FlagError(
            f"--speculative {draft_tokens}: verifies {draft_tokens + 1} tokens per step, more "
            f"than the model's rings hold at --page-size {shape.page_size} ({limit}): at most "
            f"--speculative {limit - 1}"
        )


def check_hisparse(
    pages: int | None, index_topk: int, speculative: int | None = None, page_size: int = 1
) -> None:
    """``--hisparse-pages``: one query's top-k pages plus the page it writes; with
    ``--speculative K`` (verify steps run paged) ``K + 1`` queries' pages plus the pages the
    ``K + 1`` tokens span at ``--page-size``."""
    if pages is not None and pages < index_topk + 1:
        raise FlagError(
            f"--hisparse-pages {pages} cannot hold one query's top-{index_topk} pages plus the "
            f"page it writes: at least {index_topk + 1}"
        )
    t = 1 + (speculative or 0)
    written = max_pages_spanned(t, page_size)
    if pages is not None and t > 1 and pages < t * index_topk + written:
        raise FlagError(
            f"--hisparse-pages {pages} cannot hold a verify step of --speculative {t - 1}: "
            f"{t} queries' top-{index_topk} pages plus {written} written, at least "
            f"{t * index_topk + written}"
        )


def check_temperature(temperature: float, low: float, high: float) -> None:
    """``--temperature``: 0 (greedy) or within the sampler's ``[low, high]``."""
    if temperature != 0 and not low <= temperature <= high:
        raise FlagError(
            f"--temperature {temperature:g}: must be 0 (greedy) or in [{low:g}, {high:g}]"
        )


#: API names that reach a CLI user through an error or a refusal, in the user's terms (a
#: pool's capacity may come from --pool-budget-gib, so the pools are named, not their flags).
_FLAG_TERMS = (
    (r"\bswa_capacity=(\d+)", r"the SWA pool of \1 tokens"),
    (r"\bfull_capacity=(\d+)", r"the full pool of \1 tokens"),
    (r"\bswa_capacity\b", "the SWA pool"),
    (r"\bfull_capacity\b", "the full pool"),
    (r"\bpage_size=(\d+)", r"--page-size \1"),
    (
        r"\bfixed_bytes=(\d+) leaves no budget of (\d+)",
        r"the pools' \1 fixed bytes leave nothing of a budget of \2 bytes",
    ),
    (r"\bchunk_tokens\b", "--chunk-tokens"),
    (r"\bspeculative_tokens\b", "--speculative"),
    (r"\bhisparse_pages\b", "--hisparse-pages"),
    (r"\bmax_new_tokens\b", "--max-new-tokens"),
    (r"\bmemory_budget\b", "--memory-budget-gib"),
    (r"\bbounded_replay\b", "--bounded-replay"),
)


def in_flag_terms(message: str) -> str:
    """``message`` with the API names above replaced by the flags (or pools) they come from."""
    for pattern, replacement in _FLAG_TERMS:
        message = re.sub(pattern, replacement, message)
    return message
