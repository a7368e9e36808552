"""Trained weights on disk: `ModelWeights` as a safetensors file, checked on load.

A file holds every tensor of `ModelWeights` under its dotted path (``embed``,
``layers.2.indexer.compressor.ape``, ``mtp.layer.w_q``, ...) and, as metadata, the model's
`ModelConfig` and a SHA-256 over the tensors' names, dtypes, shapes and bytes, so a corrupt file
is caught even without a recorded checksum. Shipped files (`SHIPPED`) also have the SHA-256 of
the whole file recorded here, in code. `load_weights` raises `WeightsError` for a checksum
mismatch, an unreadable file, a missing or unexpected tensor, a wrong shape or a config that does
not match the model asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapters.model.model_config import EngramPlacement, ModelConfig
from adapters.model.weights import ModelWeights, init_weights

FORMAT = "shadowradix-weights-1"
#: ModelConfig fields that do not change the tensors' meaning (``seed`` only draws them)
#: fields a file need not match: the name, the init seed, where the Engram tables are placed
_UNCHECKED_FIELDS = ("name", "seed", "engram_placement")
TRAINED_DIR = Path(__file__).resolve().parent / "trained"


@dataclass(frozen=True)
class ShippedWeights:
    """A weights file in the package, with the SHA-256 of the whole file."""

    file: str
    sha256: str | None  # None until a trained file is committed

    @property
    def path(self) -> Path:
        return TRAINED_DIR / self.file


#: the trained presets' files (docs/training.md: `python -m adapters.train` writes them)
SHIPPED: dict[str, ShippedWeights] = {
    "tiny-trained": ShippedWeights(
        "tiny-trained.safetensors",
        "9aa7e6cfa88838d87fa7d245e6e216bfe9068bfe1d878036212a723ef79ed816",
    ),
    # tiny-shared's layout, trained (bench/sessions/issue15_d.sh, docs/training.md)
    "tiny-shared-trained": ShippedWeights(
        "tiny-shared-trained.safetensors",
        "c73e6e577a036bbbda4656ef22894f02c0e60bf7cae575cdeb8ea4b3d19ba125",
    ),
}

#: the EAGLE draft heads (`adapters.model.eagle`), by the preset of the target they read
SHIPPED_EAGLE: dict[str, ShippedWeights] = {
    "tiny-trained": ShippedWeights(
        "tiny-trained-eagle.safetensors",
        "283facc947620aac25febd63e1498a81885a2f3f0dcb05507c9887fca042c7de",
    ),
}


class WeightsError(ValueError):
    """A weights file that cannot be used: its checksum, its tensors or its config."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = str(path), problem


def _leaves(obj: Any, prefix: str) -> Iterator[tuple[str, Any, str]]:
    """``(name, owner, field)`` of every tensor field under the dataclass ``obj``."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if isinstance(value, torch.Tensor):
            yield name, obj, f.name
        elif dataclasses.is_dataclass(value) and not isinstance(value, ModelConfig):
            yield from _leaves(value, name + ".")
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                yield from _leaves(item, f"{name}.{i}.")


def state_dict(weights: ModelWeights) -> dict[str, torch.Tensor]:
    """Every tensor of ``weights`` by its dotted path (the tensors themselves, not copies)."""
    return {name: getattr(owner, field) for name, owner, field in _leaves(weights, "")}


def _rebuild(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if isinstance(value, torch.Tensor):
            changes[f.name] = tensors[name]
        elif dataclasses.is_dataclass(value) and not isinstance(value, ModelConfig):
            changes[f.name] = _rebuild(value, name + ".", tensors)
        elif isinstance(value, tuple):
            changes[f.name] = tuple(
                _rebuild(item, f"{name}.{i}.", tensors) for i, item in enumerate(value)
            )
    return dataclasses.replace(obj, **changes)


@functools.lru_cache(maxsize=2)
def _template(cfg: ModelConfig) -> ModelWeights:
    """A model of ``cfg`` to take the structure from (seeded random weights, on the CPU: the
    meta device's first use costs seconds; kept, since training rebuilds every step)."""
    return init_weights(cfg)


def skeleton(cfg: ModelConfig) -> dict[str, torch.Size]:
    """The tensor names and shapes a model of ``cfg`` has."""
    return {name: t.shape for name, t in state_dict(_template(cfg)).items()}


def from_state_dict(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: str = "<tensors>"
) -> ModelWeights:
    """`ModelWeights` of ``cfg`` holding ``tensors`` as given (no copy, autograd intact).
    Raises `WeightsError` for a missing or unexpected name, or a wrong shape."""
    shapes = skeleton(cfg)
    missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing:
        raise WeightsError(source, f"missing tensors {missing[:4]} ({len(missing)} in all)")
    if extra:
        raise WeightsError(source, f"unexpected tensors {extra[:4]} ({len(extra)} in all)")
    for name, shape in shapes.items():
        if tensors[name].shape != shape:
            raise WeightsError(
                source, f"{name} has shape {tuple(tensors[name].shape)}, expected {tuple(shape)}"
            )
    return _rebuild(_template(cfg), "", tensors)


def content_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def file_sha256(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_weights(
    weights: ModelWeights, path: Path | str, dtype: torch.dtype = torch.bfloat16
) -> str:
    """Writes ``weights`` (in ``dtype``) to ``path``; returns the file's SHA-256."""
    from safetensors.torch import save_file

    tensors = {n: t.detach().to("cpu", dtype).contiguous() for n, t in state_dict(weights).items()}
    config = json.dumps(weights.config.plain())
    meta = {"format": FORMAT, "config": config, "content_sha256": content_sha256(tensors)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return file_sha256(path)


def _config_of(path: Path, meta: dict[str, str]) -> ModelConfig:
    if meta.get("format") != FORMAT:
        raise WeightsError(path, f"not a {FORMAT} file (format {meta.get('format')!r})")
    try:
        fields = json.loads(meta["config"])
        typed: dict[str, object] = {k: tuple(v) for k, v in fields.items() if isinstance(v, list)}
        if "engram_placement" in fields:
            typed["engram_placement"] = EngramPlacement(fields["engram_placement"])
        return ModelConfig(**{**fields, **typed})
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightsError(path, f"unreadable model config ({exc})") from None


def _check_config(path: Path, found: ModelConfig, wanted: ModelConfig) -> None:
    a, b = dataclasses.asdict(found), dataclasses.asdict(wanted)
    diff = [k for k in a if k not in _UNCHECKED_FIELDS and a[k] != b[k]]
    if diff:
        shown = ", ".join(f"{k}={a[k]!r} (model {b[k]!r})" for k in diff[:3])
        raise WeightsError(path, f"weights of another model: {shown}")


def load_weights(
    path: Path | str,
    cfg: ModelConfig | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    sha256: str | None = None,
) -> ModelWeights:
    """The weights in ``path`` as ``dtype`` on ``device``. ``sha256``: the whole file's expected
    checksum (the shipped files'); the tensors' own checksum is always verified. ``cfg``: the
    model they must fit (its ``name`` is kept); default the file's config.
    Raises `WeightsError` (a `ValueError`) as the module docstring says, `OSError` for a file
    that cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    data = path.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        got = hashlib.sha256(data).hexdigest()
        raise WeightsError(path, f"SHA-256 {got} does not match the recorded {sha256}")
    try:
        tensors = load(data)
        meta = _metadata(data)
    except (SafetensorError, ValueError) as exc:
        raise WeightsError(path, f"not a readable safetensors file ({exc})") from None
    found = _config_of(path, meta)
    if cfg is not None:
        _check_config(path, found, cfg)
    if content_sha256(tensors) != meta.get("content_sha256"):
        raise WeightsError(path, "tensor contents do not match their recorded SHA-256 (corrupt)")
    moved = {n: t.to(device, dtype) for n, t in tensors.items()}
    return from_state_dict(cfg or found, moved, str(path))


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors header (8-byte length, then JSON)."""
    size = int.from_bytes(data[:8], "little")
    if not 0 < size <= len(data) - 8:
        raise ValueError("bad header length")
    return json.loads(data[8 : 8 + size]).get("__metadata__") or {}


def shipped_path(preset_name: str) -> Path | None:
    """The shipped weights file of ``preset_name`` if the package holds one."""
    shipped = SHIPPED.get(preset_name)
    return shipped.path if shipped is not None and shipped.path.exists() else None


def default_preset() -> str:
    """``shadowradix run``'s model: ``tiny-trained`` once its weights file is in the package,
    else the random-weight ``tiny``."""
    return "tiny-trained" if shipped_path("tiny-trained") is not None else "tiny"


def load_shipped(
    cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> ModelWeights:
    """The shipped weights of the preset ``cfg.name``, verified against the recorded SHA-256.
    Raises `WeightsError` where the preset has no shipped file (or no recorded checksum)."""
    shipped = SHIPPED.get(cfg.name)
    if shipped is None:
        raise WeightsError(cfg.name, f"no shipped weights for preset {cfg.name!r}")
    if not shipped.path.exists():
        raise WeightsError(shipped.path, "not there: train it (python -m adapters.train, "
                           "docs/training.md) or pass --weights")  # fmt: skip
    if shipped.sha256 is None:
        raise WeightsError(
            shipped.path, "no SHA-256 recorded for it in adapters/model/weights_file.py"
        )
    return load_weights(shipped.path, cfg, device, dtype, sha256=shipped.sha256)
