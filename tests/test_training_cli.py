"""``python -m adapters.train`` (#15): any preset trains, V4.1 sharing included
(``tiny-shared-trained``); ``--eagle`` trains a head for the shipped target; misuse exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters.model.eagle import load_eagle
from adapters.model.model_config import preset
from adapters.model.weights_file import SHIPPED, load_shipped, load_weights
from adapters.train import main
from tests.test_training import _one_thread  # noqa: F401 - the autouse fixture: one thread

#: a few steps of tiny sequences: the CLI's plumbing, not the training
QUICK = ["--device", "cpu", "--steps", "2", "--batch", "1", "--seq-len", "48", "--warmup", "1",
         "--log-every", "1", "--eval-bytes", "96"]  # fmt: skip


def test_the_shared_preset_trains_and_its_file_loads(tmp_path: Path) -> None:
    out = tmp_path / "shared.safetensors"
    assert main([*QUICK, "--preset", "tiny-shared-trained", "--out", str(out)]) == 0
    model = preset("tiny-shared-trained")
    weights = load_weights(out, model)
    assert weights.config.kv_sources == (1, 2) and weights.layers[3].compressor is None
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["steps_done"] == 2 and record["heldout"]["bits_per_byte"] > 0


@pytest.mark.skipif(not SHIPPED["tiny-trained"].path.exists(), reason="no shipped tiny-trained")
def test_eagle_trains_a_head_for_the_shipped_target(tmp_path: Path) -> None:
    out = tmp_path / "head.safetensors"
    assert main([*QUICK, "--eagle", "--out", str(out)]) == 0
    target = load_shipped(preset("tiny-trained"))
    head = load_eagle(out, target)
    assert head.config.hidden == target.config.hidden
    record = json.loads(out.with_suffix(".json").read_text())
    assert 1.0 <= record["heldout"]["acceptance_estimate"] <= 4.0
    assert len(record["heldout"]["agreement"]) == 3


def test_misuse_exits_2(tmp_path: Path, capsys) -> None:
    # no shipped EAGLE head for the shared preset; a shared target whose file is not there
    assert main([*QUICK, "--eagle", "--preset", "tiny-shared-trained", "--ship"]) == 2
    assert "no shipped EAGLE head" in capsys.readouterr().err
    if not SHIPPED["tiny-shared-trained"].path.exists():
        assert main([*QUICK, "--eagle", "--preset", "tiny-shared-trained"]) == 2
        assert "not there" in capsys.readouterr().err
    assert main([*QUICK, "--preset", "tiny", "--ship"]) == 2
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"junk")
    assert main([*QUICK, "--eagle", "--target", str(bad)]) == 2
    assert "bad.safetensors" in capsys.readouterr().err
