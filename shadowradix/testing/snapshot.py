"""A structural, comparable picture of a cache: used to prove failed calls change nothing and
that a rolled-back draft leaves what a run without the draft would have left."""

from __future__ import annotations

from typing import Any

from ..cache import ShadowRadixCache


def snapshot(cache: ShadowRadixCache) -> tuple[Any, ...]:
    nodes = sorted(
        (
            n.start_page,
            tuple(n.tokens.tolist()),
            tuple(n.vpages.tolist()),
            tuple(n.swa_pages.tolist()),
            n.full_lock_ref,
            tuple(sorted(n.swa_locks.items())),
            n.last_access,
        )
        for n in cache._tree.nodes()
    )
    requests = tuple(
        (
            r.id,
            tuple(r.tokens),
            r.num_draft,
            tuple(r.vpages),
            r.tree_pages,
            r.terminal.start_page,
            r.terminal.end_page,
            r.swa_base,
            tuple(r.swa_pages),
            tuple(r.swa_owned),
            r.state,
        )
        for r in cache._requests.values()
    )
    return (
        tuple(nodes),
        requests,
        cache._full.free_snapshot(),
        cache._swa.free_snapshot(),
        cache._full.capacity,
        cache._swa.capacity,
        cache._tree.version,
    )
