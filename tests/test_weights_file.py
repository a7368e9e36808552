"""Weights files (#15): safetensors round trip, and a typed `WeightsError` for every way a file
can be wrong; ``shadowradix run --weights``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from adapters.cli.main import main
from adapters.model import weights_file
from adapters.model.model_config import preset
from adapters.model.weights import init_weights
from adapters.model.weights_file import (
    WeightsError,
    from_state_dict,
    load_shipped,
    load_weights,
    save_weights,
    state_dict,
)
from tests.small_models import SHORT


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("w") / "short.safetensors"
    return path, save_weights(init_weights(SHORT), path)


def test_a_saved_file_loads_as_the_bf16_rounded_weights(saved) -> None:
    path, sha = saved
    loaded = load_weights(path, SHORT, sha256=sha)
    assert loaded.config == SHORT and loaded.mtp is not None
    for name, t in state_dict(init_weights(SHORT)).items():
        assert torch.equal(state_dict(loaded)[name], t.bfloat16().float()), name
    assert load_weights(path).config == replace(SHORT, name=SHORT.name)  # the file's own config


def test_a_checksum_mismatch_or_a_corrupt_byte_is_a_weights_error(saved, tmp_path) -> None:
    path, sha = saved
    with pytest.raises(WeightsError, match="does not match the recorded"):
        load_weights(path, SHORT, sha256="0" * 64)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # a tensor byte: the file parses, its contents' checksum does not match
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="corrupt"):
        load_weights(bad, SHORT)
    bad.write_bytes(bytes(data[:100]))
    with pytest.raises(WeightsError, match="not a readable"):
        load_weights(bad, SHORT)


def test_missing_unexpected_or_misshapen_tensors_and_another_model(saved) -> None:
    path, _ = saved
    tensors = state_dict(init_weights(SHORT))
    with pytest.raises(WeightsError, match="missing tensors"):
        from_state_dict(SHORT, {k: v for k, v in tensors.items() if k != "mtp.proj"})
    with pytest.raises(WeightsError, match="unexpected tensors"):
        from_state_dict(SHORT, {**tensors, "extra": torch.zeros(1)})
    with pytest.raises(WeightsError, match="has shape"):
        from_state_dict(SHORT, {**tensors, "embed": tensors["embed"][:-1]})
    with pytest.raises(WeightsError, match="another model"):
        load_weights(path, replace(SHORT, window=32))
    assert isinstance(WeightsError("p", "x"), ValueError)


def test_a_file_of_another_format_is_refused(tmp_path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"embed": torch.zeros(2)}, str(path), metadata={"config": json.dumps({})})
    with pytest.raises(WeightsError, match="not a shadowradix-weights-1 file"):
        load_weights(path)


def test_shipped_weights_are_checked_against_the_recorded_sha(saved, monkeypatch) -> None:
    path, sha = saved
    ship = weights_file.ShippedWeights(path.name, sha)
    monkeypatch.setattr(weights_file, "TRAINED_DIR", path.parent)
    monkeypatch.setitem(weights_file.SHIPPED, SHORT.name, ship)
    assert weights_file.shipped_path(SHORT.name) == path
    monkeypatch.setitem(weights_file.SHIPPED, "tiny-trained", ship)
    assert weights_file.default_preset() == "tiny-trained"  # run's default, once shipped
    monkeypatch.setitem(weights_file.SHIPPED, "tiny-trained", replace(ship, file="absent"))
    assert weights_file.default_preset() == "tiny"
    assert load_shipped(SHORT).config == SHORT
    monkeypatch.setitem(weights_file.SHIPPED, SHORT.name, replace(ship, sha256="1" * 64))
    with pytest.raises(WeightsError, match="does not match"):
        load_shipped(SHORT)
    monkeypatch.setitem(weights_file.SHIPPED, SHORT.name, replace(ship, sha256=None))
    with pytest.raises(WeightsError, match="no SHA-256 recorded"):
        load_shipped(SHORT)
    monkeypatch.setitem(weights_file.SHIPPED, SHORT.name, replace(ship, file="absent"))
    assert weights_file.shipped_path(SHORT.name) is None
    with pytest.raises(WeightsError, match="not there"):
        load_shipped(SHORT)
    with pytest.raises(WeightsError, match="no shipped weights"):
        load_shipped(replace(SHORT, name="untrained"))


def test_run_with_weights_loads_them_and_a_bad_file_is_a_one_line_error(tmp_path, capsys) -> None:
    cfg = preset("tiny").first_layers(1)
    path = tmp_path / "one.safetensors"
    save_weights(init_weights(cfg), path)
    argv = ["run", "hi", "--device", "cpu", "--max-new-tokens", "2", "--layers", "1"]
    assert main([*argv, "--weights", str(path)]) == 0
    assert f"{path} weights in torch.float32" in capsys.readouterr().out
    assert main([*argv, "--layers", "2", "--weights", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "weights of another model" in err and "\n" not in err


def test_an_engram_model_saves_and_loads_whatever_its_placement(tmp_path) -> None:
    """The file records the config as plain values (an enum as its value); where the Engram
    tables are placed is not part of what a file must match."""
    from adapters.model.model_config import EngramPlacement

    cfg = preset("tiny-engram")
    weights = init_weights(cfg, "cpu", torch.float32)
    path = tmp_path / "engram.safetensors"
    weights_file.save_weights(weights, path)
    host = replace(cfg, engram_placement=EngramPlacement.HOST)
    loaded = weights_file.load_weights(path, host)
    assert loaded.config.engram_placement is EngramPlacement.HOST
    assert torch.equal(loaded.embed, weights.embed.to(torch.bfloat16).float())
