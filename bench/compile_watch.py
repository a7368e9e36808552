"""Which Triton kernels compile during a run, with their constexprs, and how long each took.

    from bench.compile_watch import CompileWatch
    watch = CompileWatch.install()   # before the run
    ...
    watch.events  # [(seconds since install, kernel, constexprs, compile seconds)]

Uses Triton's ``knobs.runtime.jit_cache_hook`` (called before a compile) and
``jit_post_compile_hook`` (after it); a cache hit on disk still counts as a compile here, and is
fast.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class CompileWatch:
    start: float = field(default_factory=time.perf_counter)
    events: list[tuple[float, str, str, float]] = field(default_factory=list)
    _began: float = 0.0

    @classmethod
    def install(cls) -> CompileWatch:
        from triton import knobs

        watch = cls()
        knobs.runtime.jit_cache_hook = watch._before
        knobs.runtime.jit_post_compile_hook = watch._after
        return watch

    def _before(self, **kw: object) -> bool:
        self._began = time.perf_counter()
        return False  # go on compiling

    def _after(self, **kw: object) -> bool:
        now = time.perf_counter()
        fn = kw.get("fn")
        name = getattr(fn, "name", str(fn))
        info = kw.get("compile", {})
        consts = info.get("constants", {})  # type: ignore[union-attr]
        shown = {k if isinstance(k, str) else k[0]: v for k, v in dict(consts).items()}
        attrs = info.get("configs", [None])[0]  # type: ignore[union-attr]
        spec = sorted(k[0] for k in dict(attrs or {}))  # args specialised (divisible by 16)
        text = f"{shown} specialised={spec} warps={info.get('num_warps')}"  # type: ignore[union-attr]
        self.events.append((self._began - self.start, str(name), text, now - self._began))
        return False

    def summary(self) -> str:
        lines = [f"{len(self.events)} compiles, {sum(e[3] for e in self.events):.1f} s in all"]
        lines += [
            f"  t={t:7.1f}s {dt:6.2f}s {name} {consts[:600]}" for t, name, consts, dt in self.events
        ]
        return "\n".join(lines)
