"""``bench/manifest.py``: what each result file records is read from every place a bench puts
it, files that record less are named, ``--check`` fails on them, and the committed
``bench/results/MANIFEST.md`` is the one the result files give."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
META = {"commit": "abc1234", "command": "python bench/x.py", "machine": "NVIDIA H200",
        "date": "2026-12-02 07:00:00 UTC"}  # fmt: skip


def _manifest():
    spec = importlib.util.spec_from_file_location("manifest", ROOT / "bench/manifest.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["manifest"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_facts_from_every_source(tmp_path: Path) -> None:
    m = _manifest()
    (tmp_path / "a.json").write_text(json.dumps({"meta": META, "rows": []}))
    (tmp_path / "b.json").write_text(json.dumps([{"x": 1}]))  # records nothing
    (tmp_path / "c.json").write_text(json.dumps([{"x": 1}]))
    (tmp_path / "c.meta.json").write_text(json.dumps(dict(META, date_start=META["date"])))
    (tmp_path / "d.log").write_text(repr(dict(META, host="vm")) + "\nrest\n")  # a printed dict
    (tmp_path / "e.log").write_text(
        "# meta (by hand): commit 0123abcd, command 'python bench/y.py --z', machine NVIDIA "
        "H200 (torch 2.11), date 2026-12-02\nprefill ok\n"
    )
    (tmp_path / "a.log").write_text("no header\n")  # its twin a.json has them
    (tmp_path / "f.log").write_text("no header\n")
    got = {e.name: e for e in m.collect(tmp_path)}
    assert set(got) == {"a.json", "b.json", "c.json", "d.log", "e.log", "a.log", "f.log"}
    assert got["a.json"].facts == META and got["a.json"].source == "meta"
    assert got["b.json"].missing == list(m.FACTS) and got["f.log"].missing == list(m.FACTS)
    assert got["c.json"].source == "sidecar" and not got["c.json"].missing
    assert got["d.log"].source == "first line" and got["d.log"].facts["commit"] == "abc1234"
    e = got["e.log"].facts
    assert (e["commit"], e["command"], e["machine"]) == ("0123abcd", "python bench/y.py --z",
                                                         "NVIDIA H200")  # fmt: skip
    assert got["a.log"].source == "its twin a.json" and not got["a.log"].missing
    text = m.render(list(got.values()))
    assert "5 of 7 files record all four" in text
    assert "| `b.json` | commit, command, machine, date | - |" in text
    assert m.main(["--check", str(tmp_path / "a.json"), str(tmp_path / "e.log")]) == 0
    assert m.main(["--check", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1


def test_committed_manifest_is_current() -> None:
    """Regenerate with ``python bench/manifest.py`` after adding a result file."""
    m = _manifest()
    want = m.render(m.collect(ROOT / "bench/results"))
    assert (ROOT / "bench/results/MANIFEST.md").read_text() == want
