"""The tree locks of the sglang-0.5.23-shaped shim: `TreeLock`s (``lock`` / ``unlock``) and
bare ``inc_lock_ref`` receipts, each released exactly once, over the 0.5.18 shim's pins.

A lock is backed by a pin of its node until a running request takes it over::

    lock(node)              pin held             unlock → pin released
    admission of its req    pin released: the request's own locks hold the path
    checkpoint(req)         the old lock retired, a new one on the request's tree prefix
    release_kv_cache(req)   the request's locks released by the core, its lock retired

Unlocking twice, or a receipt another holder holds, raises `LockError`.
"""

from __future__ import annotations

from ..errors import InvalidRequestError, LockError, require
from ..locks import PinReceipt
from .sglang import ShadowRadixSGLangCache
from .sglang0523_types import TreeLock
from .sglang_types import DecLockRefParams, DecLockRefResult, IncLockRefResult, TreeNode

__all__ = ["TreeLocks"]


class TreeLocks:
    def __init__(self, tree: ShadowRadixSGLangCache) -> None:
        self._tree = tree
        #: every `TreeLock` not unlocked yet, by id: the lock and the pin behind it (``None``
        #: for the root's, and once a running request's own locks hold its path)
        self._locks: dict[int, tuple[TreeLock, PinReceipt | None]] = {}
        #: `inc_lock_ref`'s pins not released yet, by id: the receipt and its node
        self._bare: dict[int, tuple[PinReceipt, TreeNode]] = {}

    def __len__(self) -> int:
        """Locks and receipts still held."""
        return len(self._locks) + len(self._bare)

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        result = self._tree.inc_lock_ref(tree_node(node))
        if result.receipt is not None:
            self._bare[id(result.receipt)] = (result.receipt, node)
        return result

    def dec_lock_ref(self, node: TreeNode, params: DecLockRefParams | None) -> DecLockRefResult:
        tree_node(node)
        if params is not None and not isinstance(params, DecLockRefParams):
            raise InvalidRequestError(f"expected DecLockRefParams, got {type(params).__name__}")
        receipt = None if params is None else params.receipt
        if receipt is None and node.prefix_len == 0:
            return DecLockRefResult(0)
        held = self._bare.get(id(receipt)) if receipt is not None else None
        if held is None or held[0] is not receipt:
            raise LockError("dec_lock_ref: not the receipt of an inc_lock_ref still held")
        if held[1] is not node:
            raise InvalidRequestError("dec_lock_ref: that receipt was taken on another node")
        del self._bare[id(receipt)]
        return self._tree.dec_lock_ref(node, params)

    def lock(self, node: TreeNode) -> TreeLock:
        result = self._tree.inc_lock_ref(tree_node(node))
        lock = TreeLock(node, result.to_dec_params())
        self._locks[id(lock)] = (lock, result.receipt)
        return lock

    def unlock(self, lock: TreeLock | None) -> None:
        if lock is not None:
            self.check_held(lock)
            _, pin = self._locks.pop(id(lock))
            if pin is not None:
                self._tree.dec_lock_ref(lock.node, DecLockRefParams(pin))

    def check_held(self, lock: object) -> None:
        """`LockError` unless ``lock`` is a `TreeLock` of these not unlocked yet."""
        if not isinstance(lock, TreeLock):
            raise InvalidRequestError(f"expected a TreeLock, got {type(lock).__name__}")
        entry = self._locks.get(id(lock))
        if entry is None or entry[0] is not lock:
            raise LockError("unlock: this TreeLock is not held (unlocked twice?)")

    def pass_to_request(self, lock: TreeLock) -> None:
        """``lock``'s request was admitted: its own locks hold the path, the pin goes."""
        _, pin = self._locks[id(lock)]
        self._locks[id(lock)] = (lock, None)
        if pin is not None:
            self._tree.dec_lock_ref(lock.node, DecLockRefParams(pin))

    def request_lock(self, node: TreeNode) -> TreeLock:
        """A lock on a running request's tree prefix, which the request's own locks hold."""
        lock = TreeLock(node, DecLockRefParams(None))
        self._locks[id(lock)] = (lock, None)
        return lock

    def check_invariants(self) -> None:
        """Every pin a lock or receipt stands for is held."""
        pins = [pin for _, pin in self._locks.values() if pin is not None]
        pins += [pin for pin, _ in self._bare.values()]
        for pin in pins:
            require(self._tree.holds_pin(pin), f"{pin!r} stands for a pin no longer held")


def tree_node(node: object) -> TreeNode:
    if not isinstance(node, TreeNode):
        raise InvalidRequestError(f"expected a TreeNode, got {type(node).__name__}")
    return node
