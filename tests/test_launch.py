"""`adapters.kernels.launch`: cached launches against a recording stand-in for a Triton kernel
(the compiled-kernel fast path needs a GPU; under the interpreter the JIT returns nothing), and
the plan cache's bounds. `tests/test_kernels.py` checks the top-k plans under the interpreter."""

from __future__ import annotations

import importlib

import pytest
import torch
from interpreted import interpreted_modules


@pytest.fixture(scope="module")
def launch():
    """The module, loaded as `tests/interpreted.py` loads kernel modules: importing Triton here
    must not switch it out of interpreter mode for the kernel tests."""
    mods = interpreted_modules(("launch",))
    if mods is None:  # pragma: no cover - a CUDA machine, or Triton imported compiled already
        return importlib.import_module("adapters.kernels.launch")
    return mods[0]


class Compiled:
    """A compiled kernel: ``compiled[grid](*args)`` records the launch."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class Kernel:
    """A ``@triton.jit`` kernel: ``kernel[grid](*args, **meta)`` records the JIT call and
    returns ``compiled`` (None, as the interpreter does)."""

    def __init__(self, compiled: Compiled | None) -> None:
        self.compiled = compiled
        self.jit_calls: list[tuple] = []

        def fn(x_ptr, n, BLOCK, FLAG=False):  # noqa: N803 - constexpr names, as in kernels
            pass

        self.fn = fn

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.jit_calls.append((grid, args, meta))
            return self.compiled

        return run


def test_first_call_compiles_later_ones_go_to_the_compiled_launcher(launch):
    compiled = Compiled()
    kernel = Kernel(compiled)
    go = launch.KernelLaunch(kernel, (4, 2), BLOCK=128, num_warps=4)
    x, y = torch.zeros(4), torch.ones(4)
    go(x, 10)
    assert kernel.jit_calls == [((4, 2, 1), (x, 10), dict(BLOCK=128, num_warps=4))]
    assert go.compiled is compiled and compiled.launches == []
    go(y, 11)
    go(x, 12)
    # every bound argument in signature order: runtime ones, constexprs, defaults (no options)
    assert compiled.launches == [((4, 2, 1), (y, 11, 128, False)), ((4, 2, 1), (x, 12, 128, False))]
    assert len(kernel.jit_calls) == 1


def test_no_compiled_kernel_means_every_call_through_the_jit(launch, monkeypatch):
    kernel = Kernel(None)  # the interpreter
    go = launch.KernelLaunch(kernel, (1,), BLOCK=16, FLAG=True)
    for n in range(3):
        go(torch.zeros(1), n)
    assert [c[1][1] for c in kernel.jit_calls] == [0, 1, 2] and go.compiled is None
    for off in ("_FAST", "CACHE_LAUNCHES"):  # an old Triton; the cache switched off
        with monkeypatch.context() as m:
            m.setattr(launch, off, False)
            compiled = Compiled()
            kernel = Kernel(compiled)
            go = launch.KernelLaunch(kernel, (1,), BLOCK=16)
            go(torch.zeros(1), 1)
            go(torch.zeros(1), 2)
            assert len(kernel.jit_calls) == 2 and compiled.launches == [] and go.compiled is None


def test_a_constexpr_without_value_is_refused(launch):
    go = launch.KernelLaunch(Kernel(Compiled()), (1,), num_warps=4)
    with pytest.raises(TypeError, match="BLOCK"):
        go(torch.zeros(1), 1)


def test_fast_launch_needs_a_recent_triton(launch):
    assert launch.fast_launch_supported("3.6.0") and launch.fast_launch_supported("3.10.0+git1a")
    assert launch.fast_launch_supported("4.0") and launch.fast_launch_supported("3.3.1")
    assert not launch.fast_launch_supported("3.2.0") and not launch.fast_launch_supported("2.9")


def test_aligned_is_triton_pointer_specialisation(launch):
    x = torch.zeros(64)
    assert launch.aligned(x) and launch.aligned(x[4:]) and not launch.aligned(x[1:])


def test_plan_cache_is_a_bounded_lru(launch, monkeypatch):
    cache: launch.PlanCache[str] = launch.PlanCache(capacity=2)
    built: list[str] = []

    def build(key: str):
        built.append(key)
        return key.upper()

    assert cache.get("a", lambda: build("a")) == "A"
    assert cache.get("b", lambda: build("b")) == "B"
    assert cache.get("a", lambda: build("a")) == "A"  # a hit: "a" is the most recent now
    cache.get("c", lambda: build("c"))  # evicts "b"
    assert built == ["a", "b", "c"] and len(cache) == 2
    cache.get("b", lambda: build("b"))
    cache.get("a", lambda: build("a"))  # "a" was evicted by "b"
    assert built == ["a", "b", "c", "b", "a"]
    cache.discard("a")
    cache.discard("missing")
    assert len(cache) == 1
    cache.clear()
    assert len(cache) == 0
    monkeypatch.setattr(launch, "CACHE_LAUNCHES", False)
    cache.get("a", lambda: build("a"))
    cache.get("a", lambda: build("a"))
    assert built[-2:] == ["a", "a"] and len(cache) == 0
    with pytest.raises(ValueError):
        launch.PlanCache(0)
