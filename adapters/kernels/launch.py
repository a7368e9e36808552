"""Cached Triton launches: a kernel's grid and compile-time arguments fixed once, later launches
straight to the compiled kernel's launcher.

``kernel[grid](*args, **meta)`` costs tens of microseconds of host time per launch before the
driver sees it: Triton binds the arguments, specialises every one of them (dtypes, 16-byte
alignment, integer divisibility), builds a cache key, looks the compiled kernel up and re-checks
the globals the kernel read. A kernel whose call is only a few microseconds of GPU work is then
bound by the host whenever it runs eagerly (outside CUDA graphs).

`KernelLaunch` holds one launch whose grid and ``meta`` (constexprs and options such as
``num_warps``, ``launch_pdl``, ``maxnreg``) never change: its first call goes through the JIT
(compiling, or finding the compiled kernel) and keeps the compiled kernel; later calls hand the
runtime arguments, with the constexpr values appended, to the compiled kernel's own launcher
(``CompiledKernel[grid]``, which still reads the current device and stream on each call, so
launches inside a CUDA-graph capture are captured as before). `PlanCache` keeps a bounded number
of launch plans by key.

The contract that makes skipping the specialisation sound: a cached launch's later runtime
arguments must specialise exactly as its first ones did. A plan is keyed on everything that
decides them (shapes, strides, integer arguments, dtypes, and `aligned` for every pointer that
is not a fresh allocation) and holds its launches; new values of any of those make a new plan.

Under ``TRITON_INTERPRET=1`` the JIT returns no compiled kernel, and a Triton older than
`FAST_MIN_TRITON` (whose launchers take other arguments) keeps its own: every call then goes
through ``kernel[grid]``.

``ADAPTERS_LAUNCH_CACHE=0`` in the environment (or `CACHE_LAUNCHES` set False at run time) turns
both off: every `PlanCache.get` builds a fresh plan and every launch goes through the JIT, as
before this module existed (an escape hatch, and the baseline of `bench/topk_eager.py`).
"""

from __future__ import annotations

import inspect
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch
import triton

__all__ = ["FAST_MIN_TRITON", "KernelLaunch", "PlanCache", "aligned", "fast_launch_supported"]

# `JITFunction.run` passes every bound argument (constexprs included, in the signature's order)
# to the compiled kernel's launcher, as `CompiledKernel[grid]` takes them: read in Triton 3.3, 3.6
# and 3.9 (older ones passed only the non-constexpr arguments).
FAST_MIN_TRITON = (3, 3)

P = TypeVar("P")


def fast_launch_supported(version: str = triton.__version__) -> bool:
    """Whether this Triton's compiled kernels take the launch arguments `KernelLaunch` passes."""
    major, minor = (
        int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:2]
    )
    return (major, minor) >= FAST_MIN_TRITON


_FAST = fast_launch_supported()
CACHE_LAUNCHES: bool = os.environ.get("ADAPTERS_LAUNCH_CACHE", "1") != "0"


def aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s data is 16-byte aligned, as Triton specialises pointer arguments."""
    return t.data_ptr() % 16 == 0


class KernelLaunch:
    """``kernel[grid](*args, **meta)`` with ``grid`` and ``meta`` fixed: see the module doc.

    ``meta`` names constexpr parameters and launch options; the runtime arguments are passed
    positionally and must come first in the kernel's signature (parameters after them take their
    value from ``meta`` or their default). `compiled` is None until the first call returns a
    compiled kernel (never under the interpreter: every call then goes through the JIT)."""

    def __init__(self, kernel: Any, grid: tuple[int, ...], **meta: Any) -> None:
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.meta = meta
        self.compiled: Any = None
        self._run: Callable[..., None] | None = None
        self._tail: tuple[Any, ...] = ()

    def __call__(self, *args: Any) -> None:
        if self._run is not None:
            self._run(*args, *self._tail)
            return
        compiled = self.kernel[self.grid](*args, **self.meta)
        if CACHE_LAUNCHES and _FAST and compiled is not None and hasattr(compiled, "__getitem__"):
            self._tail = self._trailing(len(args))
            self.compiled = compiled
            self._run = compiled[self.grid]

    def _trailing(self, given: int) -> tuple[Any, ...]:
        """Values of the parameters after the first ``given``: from ``meta``, else defaults."""
        params = list(inspect.signature(self.kernel.fn).parameters.values())[given:]
        missing = [p.name for p in params if p.name not in self.meta and p.default is p.empty]
        if missing:
            raise TypeError(f"{self.kernel.fn.__name__}: no value for {missing}")
        return tuple(self.meta.get(p.name, p.default) for p in params)


class PlanCache(Generic[P]):
    """At most ``capacity`` plans by key, the least recently used dropped first (shapes that
    vary call by call must not grow it without bound)."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._plans: OrderedDict[Hashable, P] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], P]) -> P:
        """The plan for ``key``, built by ``build()`` on a miss (always, without
        `CACHE_LAUNCHES`)."""
        if not CACHE_LAUNCHES:
            return build()
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build()
            if len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def discard(self, key: Hashable) -> None:
        """Drops ``key``'s plan, if any (a plan whose launch failed may hold a broken one)."""
        self._plans.pop(key, None)

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()
