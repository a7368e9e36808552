"""docs/integrations.md: every Python example runs as written, and the page is linked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGE = DOCS / "integrations.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_the_page_has_examples_and_is_linked() -> None:
    assert len(EXAMPLES) >= 3
    readme = (DOCS.parent / "README.md").read_text()
    assert "docs/integrations.md" in readme
    assert "integrations.md" in (DOCS / "api.md").read_text()


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    code = compile(EXAMPLES[index], f"{PAGE.name}, example {index + 1}", "exec")
    exec(code, {"__name__": f"integrations_example_{index}"})
    assert capsys.readouterr().out  # each example prints what it shows
