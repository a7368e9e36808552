"""An EAGLE-style draft head: one small decoder layer over the target's hidden state.

Step ``j`` of a draft reads a *feature* (the target's last hidden state, `final_hidden`, at
step 0; the head's own output after that) and the embedding of a token (the pending token at
step 0; the token the head drafted at the step before), RMS-norms each, projects their
concatenation ``2D -> D`` and runs one pre-norm decoder layer (multi-head attention with RoPE,
then a SwiGLU FFN, plain residuals). The layer attends only to the rows of its own chain
(steps ``0..j``: a KV of at most ``k`` rows per request, held in tensors, never in the pools).
Its output is a predicted feature: the target's own final norm and head turn it into logits
(EAGLE-1: the draft regresses the target's features and reuses its LM head). docs/speculative.md.

The same `draft_chain` runs in training (teacher-forced tokens, every position of a batch of
sequences at once) and in `adapters.engine.eagle_draft` (drafted tokens, one row per request).

Files: `save_eagle` / `load_eagle` write and check a safetensors file that records the head's
config, its tensors' SHA-256 and the fingerprint of the target weights it was trained against;
a head is refused (`WeightsError`) for another target.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.model import ops
from adapters.model.model import head_logits
from adapters.model.model_config import ModelConfig
from adapters.model.weights import ModelWeights
from adapters.model.weights_file import (
    SHIPPED_EAGLE,
    WeightsError,
    content_sha256,
    file_sha256,
    state_dict,
)

FORMAT = "shadowradix-eagle-1"
#: offset of the head's generator seed from its config's seed (a stream of its own)
EAGLE_SEED_OFFSET = 0x4541474C


@dataclass(frozen=True)
class EagleConfig:
    """The head's shape. ``hidden`` and ``vocab_size`` are the target's."""

    hidden: int = 256
    vocab_size: int = 258
    num_heads: int = 4
    head_dim: int = 64
    rope_dim: int = 16
    mlp_hidden: int = 512
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.hidden, self.vocab_size, self.num_heads, self.head_dim, self.mlp_hidden) < 1:
            raise ValueError(f"bad EAGLE head sizes: {self}")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError("rope_dim must be even with 0 < rope_dim <= head_dim")

    @classmethod
    def for_target(cls, target: ModelConfig, **overrides: object) -> EagleConfig:
        """A head for ``target``: its hidden size, vocabulary, norm eps and RoPE base."""
        base = dict(hidden=target.hidden, vocab_size=target.vocab_size,
                    rope_theta=target.rope_theta, norm_eps=target.norm_eps)  # fmt: skip
        return cls(**{**base, **overrides})  # type: ignore[arg-type]

    @property
    def scale(self) -> float:
        return float(self.head_dim) ** -0.5


@dataclass(frozen=True)
class EagleWeights:
    config: EagleConfig
    feature_norm: torch.Tensor  # (D,)
    embed_norm: torch.Tensor  # (D,)
    proj: torch.Tensor  # (2D, D)
    attn_norm: torch.Tensor  # (D,)
    w_q: torch.Tensor  # (D, H*d)
    w_k: torch.Tensor  # (D, H*d)
    w_v: torch.Tensor  # (D, H*d)
    w_o: torch.Tensor  # (H*d, D)
    ffn_norm: torch.Tensor  # (D,)
    w_gate: torch.Tensor  # (D, M)
    w_up: torch.Tensor  # (D, M)
    w_down: torch.Tensor  # (M, D)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by its field name (the tensors themselves)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "config"}  # fmt: skip

    def to(self, device: torch.device | str, dtype: torch.dtype) -> EagleWeights:
        moved = {n: t.to(device, dtype) for n, t in self.tensors().items()}
        return EagleWeights(self.config, **moved)


def _shapes(cfg: EagleConfig) -> dict[str, tuple[int, ...]]:
    d, hd, m = cfg.hidden, cfg.num_heads * cfg.head_dim, cfg.mlp_hidden
    return dict(feature_norm=(d,), embed_norm=(d,), proj=(2 * d, d), attn_norm=(d,),
                w_q=(d, hd), w_k=(d, hd), w_v=(d, hd), w_o=(hd, d), ffn_norm=(d,),
                w_gate=(d, m), w_up=(d, m), w_down=(m, d))  # fmt: skip


def init_eagle(
    cfg: EagleConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> EagleWeights:
    """Seeded random weights (norms near 1, matrices ``N(0, 1/fan_in)``), the same on every
    device."""
    gen = torch.Generator().manual_seed(cfg.seed + EAGLE_SEED_OFFSET)
    tensors = {}
    for name, shape in _shapes(cfg).items():
        t = torch.randn(*shape, generator=gen)
        t = 1.0 + 0.05 * t if len(shape) == 1 else t * shape[0] ** -0.5
        tensors[name] = t.to(device, dtype)
    return EagleWeights(cfg, **tensors)


def from_tensors(cfg: EagleConfig, tensors: dict[str, torch.Tensor], source: str) -> EagleWeights:
    """`EagleWeights` holding ``tensors`` as given. Raises `WeightsError` for a missing or
    unexpected name or a wrong shape."""
    shapes = _shapes(cfg)
    if set(tensors) != set(shapes):
        raise WeightsError(source, f"EAGLE tensors {sorted(set(tensors) ^ set(shapes))[:4]} "
                           "missing or unexpected")  # fmt: skip
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise WeightsError(source, f"{name} has shape {tuple(tensors[name].shape)}, "
                               f"expected {shape}")  # fmt: skip
    return EagleWeights(cfg, **tensors)


# -- the maths -----------------------------------------------------------------------------------


def eagle_step(
    target: ModelWeights,
    head: EagleWeights,
    feature: torch.Tensor,
    tokens: torch.Tensor,
    past: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """One draft step for ``N`` chains: the predicted feature ``(N, D)`` after ``feature``
    ``(N, D)`` and ``tokens`` ``(N,)``. ``past`` holds the chains' keys and values of their
    earlier steps; this step's are appended (its position in the chain is ``len(past)``)."""
    c, n = head.config, feature.shape[0]
    f = ops.rms_norm(feature.to(head.proj.dtype), head.feature_norm, c.norm_eps)
    e = ops.rms_norm(target.embed[tokens].to(head.proj.dtype), head.embed_norm, c.norm_eps)
    x = torch.cat((f, e), dim=-1) @ head.proj
    xn = ops.rms_norm(x, head.attn_norm, c.norm_eps)
    pos = torch.full((n,), len(past), device=x.device, dtype=torch.long)
    q = ops.rope((xn @ head.w_q).view(n, c.num_heads, c.head_dim), pos, c.rope_dim, c.rope_theta)
    k = ops.rope((xn @ head.w_k).view(n, c.num_heads, c.head_dim), pos, c.rope_dim, c.rope_theta)
    past.append((k, (xn @ head.w_v).view(n, c.num_heads, c.head_dim)))
    dt = ops.acc_dtype(q)
    keys = torch.stack([kv[0] for kv in past], dim=1).to(dt)  # (N, j + 1, H, d)
    values = torch.stack([kv[1] for kv in past], dim=1).to(dt)
    p = torch.softmax(torch.einsum("nhd,njhd->nhj", q.to(dt), keys) * c.scale, dim=-1)
    attn = torch.einsum("nhj,njhd->nhd", p, values).to(x.dtype)
    x = x + attn.reshape(n, -1) @ head.w_o
    return x + ops.swiglu(ops.rms_norm(x, head.ffn_norm, c.norm_eps), head.w_gate, head.w_up,
                          head.w_down)  # fmt: skip


def eagle_logits(target: ModelWeights, feature: torch.Tensor) -> torch.Tensor:
    """fp32 logits of predicted features: the target's final norm and head."""
    return head_logits(target, feature.to(target.head.dtype))


#: picks step ``j``'s tokens ``(N,)`` from its logits ``(N, V)``: argmax, a sampler, or the
#: teacher-forced next tokens of training
Pick = Callable[[torch.Tensor, int], torch.Tensor]


def greedy(logits: torch.Tensor, j: int) -> torch.Tensor:
    return logits.argmax(dim=-1)


def draft_chain(
    target: ModelWeights,
    head: EagleWeights,
    feature: torch.Tensor,
    tokens: torch.Tensor,
    num_steps: int,
    pick: Pick = greedy,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``num_steps`` chained steps from ``feature`` ``(N, D)`` (the target's hidden state
    before ``tokens``) and ``tokens`` ``(N,)``: step ``j`` feeds its predicted feature and
    ``pick(logits_j, j)`` to step ``j + 1``. Returns the picked tokens ``(N, k)``, the logits
    ``(N, k, V)`` and the predicted features ``(N, k, D)``. Tensor ops only (capturable)."""
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    picked, logits, features = [], [], []
    for j in range(num_steps):
        feature = eagle_step(target, head, feature, tokens, past)
        logits.append(eagle_logits(target, feature))
        features.append(feature)
        tokens = pick(logits[-1], j)
        picked.append(tokens)
    return torch.stack(picked, 1), torch.stack(logits, 1), torch.stack(features, 1)


# -- files ---------------------------------------------------------------------------------------


def target_fingerprint(target: ModelWeights) -> str:
    """SHA-256 of the target's tensors rounded to bf16 (as shipped files hold them): the same
    for the shipped file loaded in any dtype."""
    return content_sha256({n: t.detach().to("cpu", torch.bfloat16)
                           for n, t in state_dict(target).items()})  # fmt: skip


def save_eagle(
    head: EagleWeights, target: ModelWeights, path: Path | str, dtype=torch.bfloat16
) -> str:
    """Writes ``head`` (in ``dtype``), trained for ``target``; returns the file's SHA-256."""
    from safetensors.torch import save_file

    tensors = {n: t.detach().to("cpu", dtype).contiguous() for n, t in head.tensors().items()}
    meta = dict(format=FORMAT, config=json.dumps(dataclasses.asdict(head.config)),
                target=target.config.name, target_sha256=target_fingerprint(target),
                content_sha256=content_sha256(tensors))  # fmt: skip
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return file_sha256(path)


def load_eagle(path: Path | str, target: ModelWeights, sha256: str | None = None) -> EagleWeights:
    """The head in ``path`` on ``target``'s device and dtype. Raises `WeightsError` for a
    file-checksum mismatch (``sha256``), an unreadable file, corrupt tensors, a wrong shape, or
    a head trained for other target weights; `OSError` for a file that cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    data = path.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise WeightsError(path, f"SHA-256 does not match the recorded {sha256}")
    try:
        tensors = load(data)
        size = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
        cfg = EagleConfig(**json.loads(meta["config"]))
    except (SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(path, f"not a readable EAGLE head file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise WeightsError(path, f"not a {FORMAT} file (format {meta.get('format')!r})")
    if content_sha256(tensors) != meta.get("content_sha256"):
        raise WeightsError(path, "tensor contents do not match their recorded SHA-256 (corrupt)")
    if meta.get("target_sha256") != target_fingerprint(target):
        raise WeightsError(path, f"a head trained for other weights ({meta.get('target')!r}), "
                           f"not these {target.config.name!r} weights")  # fmt: skip
    head = from_tensors(cfg, tensors, str(path))
    return head.to(target.device, target.dtype)


def load_shipped_eagle(target: ModelWeights) -> EagleWeights:
    """The shipped head of the preset ``target.config.name``, checked against the recorded
    SHA-256 and the target's weights. Raises `WeightsError` where there is none (yet)."""
    shipped = SHIPPED_EAGLE.get(target.config.name)
    if shipped is None:
        raise WeightsError(target.config.name, "no shipped EAGLE head for this preset")
    if not shipped.path.exists():
        raise WeightsError(shipped.path, "not there: train it (python -m adapters.train "
                           "--eagle, docs/training.md)")  # fmt: skip
    if shipped.sha256 is None:
        raise WeightsError(shipped.path, "no SHA-256 recorded for it in weights_file.py")
    return load_eagle(shipped.path, target, sha256=shipped.sha256)
