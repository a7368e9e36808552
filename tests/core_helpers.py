"""Small helpers of the core's tests."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from shadowradix import Request, ShadowRadixCache


def cached(cache: ShadowRadixCache, prompt: Sequence[int], namespace: Hashable = None) -> Request:
    """Admit ``prompt``, compute what its match left, finish: the prompt is in the tree."""
    r = cache.admit(prompt, namespace=namespace)
    cache.extend(r, r.prompt_remaining)
    cache.finish(r)
    return r
