"""Every example in README.md and docs/*.md runs as written: each ```python block that starts
with an import is executed in a fresh interpreter (```py blocks are signature listings, and
```python blocks without imports are fragments of the reference; neither runs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _examples() -> list[tuple[str, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            code = m.group(1)
            first = code.lstrip().split("\n", 1)[0]
            if first.startswith(("import ", "from ")):
                line = text[: m.start()].count("\n") + 1
                found.append((f"{path.relative_to(ROOT)}:{line}", code))
    return found


EXAMPLES = _examples()


def test_the_readme_example_is_collected() -> None:
    assert any(where.startswith("README.md:") for where, _ in EXAMPLES)


@pytest.mark.parametrize("code", [c for _, c in EXAMPLES], ids=[w for w, _ in EXAMPLES])
def test_doc_example_runs(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_api_md_lists_the_cache_config_defaults() -> None:
    """docs/api.md's `CacheConfig(...)` signature names every field with its real default."""
    import dataclasses

    from shadowradix import CacheConfig
    from shadowradix.config import V4_FLASH_RATIOS

    text = (ROOT / "docs/api.md").read_text(encoding="utf-8")
    start = text.index("```python\nCacheConfig(\n")
    block = text[start : text.index("\n)\n", start)]
    listed = dict(re.findall(r"^    (\w+): [^=]+= (.+?),\s*(?:#.*)?$", block, re.M))
    fields = {f.name: f.default for f in dataclasses.fields(CacheConfig) if f.init}
    assert set(listed) == set(fields)
    names = {"V4_FLASH_RATIOS": V4_FLASH_RATIOS}
    for name, default in fields.items():
        assert eval(listed[name], names) == default, name  # noqa: S307 - our own docs
