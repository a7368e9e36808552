"""Running Triton kernels under Triton's CPU interpreter, for any test module.

The interpreter must be on (``TRITON_INTERPRET=1``) before Triton is first imported and before
the ``@triton.jit`` decorators run. On a machine without CUDA where Triton is not imported yet
(or was imported interpreted), `load_interpreted` sets the variable, imports Triton, loads
private copies of the named kernel modules (and of every kernel module they import: a kernel
split over several files runs interpreted as a whole) and restores the variable (so the kernel
lines count for coverage). Otherwise (a CUDA machine, or Triton already imported for real)
`run_check` runs every check of the test module in one child process with the interpreter on.
Without Triton the checks are skipped (`NO_TRITON`).

Speed: Triton's interpreter patches ``triton.language`` for the interpreter (``_patch_lang``:
``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math``, ...) at every launch and again
at every call of a ``@triton.jit`` helper inside the kernel, each time with the same patches:
about half the interpreted time of the top-k kernels. `fast_language_patches` (installed by
`load_interpreted`) patches each language module once per launch (a helper's call patches
only the modules its launch has not patched yet) and restores them all when the launch ends;
the kernels run the same. ``SHADOWRADIX_INTERPRETER_REPATCH=1`` keeps Triton's own behaviour;
a Triton whose interpreter lacks these internals keeps it too.

A test module lists its checks (functions taking the interpreted modules) and runs each one
through ``run_check(mods, check, checks, __file__)`` with ``mods = interpreted_modules(names)``
from a module-scoped fixture.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KERNEL_DIR = ROOT / "adapters" / "kernels"
NO_TRITON = "triton is not installed: the Triton kernels are not tested (pip install triton)"


def triton_state() -> str:
    """``missing``, ``fresh`` (not imported yet), ``interpreted`` or ``compiled``."""
    if importlib.util.find_spec("triton") is None:
        return "missing"
    if "triton" not in sys.modules:
        return "fresh"
    import triton.language as tl

    return "interpreted" if type(tl.zeros).__name__ == "InterpretedFunction" else "compiled"


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    """TRITON_INTERPRET=1 for the duration (Triton reads it at import, at decoration, and in
    modules it imports lazily), then restored."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:  # pragma: no cover - only when the caller had set it
            os.environ["TRITON_INTERPRET"] = before


class _NoPatches:
    """What a launch's (or a helper's) ``_patch_lang`` returns under `fast_language_patches`:
    the patches it made are restored when the launch ends."""

    def restore(self) -> None:
        pass


def fast_language_patches() -> bool:
    """Makes the interpreter patch each language module once per launch (see the module
    docstring); whether it is on. Idempotent."""
    if os.environ.get("SHADOWRADIX_INTERPRETER_REPATCH") == "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without the interpreter module
        return False
    grid_cls = getattr(interpreter, "GridExecutor", None)
    real_patch = getattr(interpreter, "_patch_lang", None)
    lang = getattr(interpreter, "tl", None)
    if grid_cls is None or real_patch is None or lang is None:  # pragma: no cover - other Triton
        return False
    if getattr(real_patch, "_shadowradix_once", False):
        return True
    real_call = grid_cls.__call__
    active: dict = {"langs": None, "scopes": []}

    def langs_of(fn: Callable) -> set[int]:  # as `_patch_lang` picks them
        glob = getattr(fn, "__globals__", {})
        return {id(v) for v in glob.values() if isinstance(v, types.ModuleType)
                and v in (lang, lang.core)}  # fmt: skip

    def patch_lang(fn: Callable):  # type: ignore[no-untyped-def]
        langs = active["langs"]
        if langs is None:  # outside a launch: as Triton does it
            return real_patch(fn)
        need = langs_of(fn)
        if not need or not need <= langs:
            active["scopes"].append(real_patch(fn))
            langs |= need
        return _NoPatches()

    def grid_call(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if active["langs"] is not None:  # pragma: no cover - a launch within a launch
            return real_call(self, *args, **kwargs)
        active["langs"] = set()
        try:
            return real_call(self, *args, **kwargs)
        finally:
            scopes, active["scopes"], active["langs"] = active["scopes"], [], None
            for scope in reversed(scopes):  # the helpers' patches first, the launch's last
                scope.restore()

    patch_lang._shadowradix_once = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    grid_cls.__call__ = grid_call
    return True


def load_interpreted(names: tuple[str, ...]) -> tuple[types.ModuleType, ...]:
    """Private copies of ``adapters/kernels/<name>.py``, loaded with the interpreter on (Triton
    too, if it was not imported yet), named ``adapters.kernels._interpreted_<name>``. The kernel
    modules they import relatively (`kernel_imports`) get private copies first, one per name,
    which stand under their real names in `sys.modules` only while the copies load; what was
    there before is put back."""
    with interpreting():
        import triton  # noqa: F401

        try:  # imported lazily by triton.runtime.jit; it asserts interpreter mode at import
            import triton.experimental.gluon  # noqa: F401
        except ImportError:  # pragma: no cover - older Triton
            pass
        fast_language_patches()
        loaded: dict[str, types.ModuleType] = {}
        saved: dict[str, types.ModuleType | None] = {}
        try:
            return tuple(_load_private(name, loaded, saved) for name in names)
        finally:
            for real, before in saved.items():
                if before is None:
                    sys.modules.pop(real, None)
                else:
                    sys.modules[real] = before


def _load_private(
    name: str, loaded: dict[str, types.ModuleType], saved: dict[str, types.ModuleType | None]
) -> types.ModuleType:
    """The private copy of kernel module ``name``, after those of the kernel modules it
    imports, each put in `sys.modules` under its real name (what stood there kept in
    ``saved``)."""
    if name in loaded:
        return loaded[name]
    for dep in kernel_imports(name):
        mod = _load_private(dep, loaded, saved)
        real = f"adapters.kernels.{dep}"
        saved.setdefault(real, sys.modules.get(real))
        sys.modules[real] = mod
    spec = importlib.util.spec_from_file_location(
        f"adapters.kernels._interpreted_{name}", KERNEL_DIR / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    loaded[name] = mod
    return mod


@functools.cache
def kernel_imports(name: str) -> tuple[str, ...]:
    """The modules of ``adapters/kernels`` that ``<name>.py`` imports relatively (``from .x
    import ...``) and that must run interpreted too: those that define ``@triton.jit``
    functions or import such a module (a launcher holding a kernel)."""
    deps = [dep for dep in _relative_imports(name) if _needs_interpreter(dep)]
    return tuple(dict.fromkeys(deps))


def _relative_imports(name: str) -> list[str]:
    tree = ast.parse((KERNEL_DIR / f"{name}.py").read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            dep = node.module.split(".")[0]
            if (KERNEL_DIR / f"{dep}.py").is_file():
                found.append(dep)
    return found


@functools.cache
def _needs_interpreter(name: str) -> bool:
    """Whether ``adapters/kernels/<name>.py`` decorates a function with ``triton.jit`` or
    imports a kernel module that needs the interpreter."""
    tree = ast.parse((KERNEL_DIR / f"{name}.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target) == "triton.jit":
                    return True
    return bool(kernel_imports(name))


def thorough() -> bool:
    """Whether the checks run their variants too (a case that only repeats a path or an edge
    case already checked, e.g. the ``sorted=True`` stage behind every algorithm, which does not
    depend on it): the Hypothesis ``thorough`` profile (``--hypothesis-profile=thorough``, or
    ``HYPOTHESIS_PROFILE=thorough``) or ``SHADOWRADIX_THOROUGH=1`` (the child process of a CUDA
    machine gets it from its parent)."""
    from hypothesis import settings

    if os.environ.get("SHADOWRADIX_THOROUGH") == "1":
        return True
    name = getattr(settings, "get_current_profile_name", None)
    current = name() if name is not None else getattr(settings, "_current_profile", None)
    return current == "thorough"


def interpreted_modules(names: tuple[str, ...]) -> tuple[types.ModuleType, ...] | None:
    """The interpreted modules, or None: the checks then run in a child process. Skips the
    test without Triton."""
    state = triton_state()
    if state == "missing":
        pytest.skip(NO_TRITON)
    if state in ("fresh", "interpreted") and not torch.cuda.is_available():
        return load_interpreted(names)
    return None  # pragma: no cover - a CUDA machine, or Triton already compiled-mode


_CHILD = """
import importlib.util, json, sys, traceback
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from interpreted import load_interpreted
spec = importlib.util.spec_from_file_location("kernel_tests", {path!r})
t = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t)
mods = load_interpreted(tuple({names!r}))
out = {{}}
for name in {checks!r}:
    try:
        getattr(t, name)(*mods)
        out[name] = "ok"
    except Exception:
        out[name] = traceback.format_exc()
print("@@RESULTS@@" + json.dumps(out))
"""


@functools.cache
def _child_results(  # pragma: no cover - exercised on CUDA machines only
    path: str, names: tuple[str, ...], checks: tuple[str, ...]
) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    if thorough():
        env["SHADOWRADIX_THOROUGH"] = "1"
    code = _CHILD.format(
        root=str(ROOT), tests=str(ROOT / "tests"), path=path, names=list(names), checks=list(checks)
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULTS@@"):
            return json.loads(line[len("@@RESULTS@@") :])
    raise AssertionError(f"interpreter child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def run_check(
    mods: tuple[types.ModuleType, ...] | None,
    check: Callable[..., None],
    names: tuple[str, ...],
    checks: list[str],
    test_file: str,
) -> None:
    """Runs ``check(*mods)`` under the interpreter, or its result from the child process that
    runs all of ``checks`` of ``test_file`` over the interpreted ``names``."""
    if mods is not None:
        with interpreting():
            check(*mods)
        return
    path = str(Path(test_file).resolve())  # pragma: no cover - CUDA machines
    result = _child_results(path, names, tuple(checks))[check.__name__]  # pragma: no cover
    assert result == "ok", result  # pragma: no cover
