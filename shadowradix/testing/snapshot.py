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
            n.vpages,
            n.swa_pages,
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


def canonical_snapshot(cache: ShadowRadixCache) -> tuple[Any, ...]:
    """`snapshot` up to a renaming of page ids: ids are numbered per pool in order of first
    appearance (tree nodes by position and path tokens, then requests in admission order, which
    replaces their ids) and the free
    stacks are reduced to their sizes. Two caches holding the same tree, requests, locks and
    page sharing in differently numbered pages compare equal (a batched draft's partial
    rollback against a run that extended only the accepted tokens)."""
    names: dict[str, dict[int, int]] = {"full": {}, "swa": {}}

    def rename(pool: str, pages: Any) -> tuple[int, ...]:
        table = names[pool]
        return tuple(table.setdefault(int(p), len(table)) for p in pages)

    def path_tokens(node: Any) -> tuple[int, ...]:
        return tuple(t for n in node.path_from_root() for t in n.tokens.tolist())

    ordered = sorted(cache._tree.nodes(), key=lambda n: (n.start_page, path_tokens(n)))
    nodes = tuple(
        (
            n.start_page,
            path_tokens(n),
            rename("full", n.vpages),
            rename("swa", n.swa_pages),
            n.full_lock_ref,
            tuple(sorted(n.swa_locks.items())),
            n.last_access,
        )
        for n in ordered
    )
    requests = tuple(
        (
            rank,  # not the id: ids are global counters, twins built side by side differ
            tuple(r.tokens),
            r.num_draft,
            rename("full", r.vpages),
            r.tree_pages,
            r.terminal.start_page,
            r.terminal.end_page,
            r.swa_base,
            rename("swa", r.swa_pages),
            tuple(r.swa_owned),
            r.state,
        )
        for rank, r in enumerate(sorted(cache._requests.values(), key=lambda r: r.id))
    )
    return (
        nodes,
        requests,
        len(cache._full.free_snapshot()),
        len(cache._swa.free_snapshot()),
        cache._full.capacity,
        cache._swa.capacity,
        cache._tree.version,
    )
