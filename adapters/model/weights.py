"""Deterministic random weights for the embedded model (no download, seeded)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Protocol

import torch

from adapters.model.model_config import ModelConfig


@dataclass(frozen=True)
class HyperConnection:
    """mHC parameters of one sub-block: how 4 residual streams feed it and absorb its output."""

    w_pre: torch.Tensor  # (S*D, S)
    w_post: torch.Tensor  # (S*D, S)
    w_res: torch.Tensor  # (S*D, S*S)
    b_pre: torch.Tensor
    b_post: torch.Tensor
    b_res: torch.Tensor
    norm: torch.Tensor  # (S*D,)

    @cached_property
    def w_folded(self) -> torch.Tensor:
        """``diag(norm) @ [w_pre | w_post | w_res]`` ``(S*D, 2S + S*S)``: the RMSNorm's weight
        folded into the three projections, so `ops.hc_mix` reads the wide streams once (one
        skinny matmul) and scales the few outputs by the rms instead of normalising them."""
        w = torch.cat((self.w_pre, self.w_post, self.w_res), dim=1)
        wide = torch.float64 if w.dtype == torch.float64 else torch.float32
        return (self.norm.to(wide)[:, None] * w.to(wide)).to(w.dtype)


@dataclass(frozen=True)
class Compressor:
    """Per-token (kv, score) projections of one compressed stream; ``width`` = c * dim, c = 2
    with overlap. ``ape`` is the learned bias added to the score at ``pos % ratio``."""

    w_kv: torch.Tensor  # (D, width)
    w_gate: torch.Tensor  # (D, width)
    ape: torch.Tensor  # (ratio, width)
    norm: torch.Tensor  # (dim,)


@dataclass(frozen=True)
class Indexer:
    """The lightning indexer of one C4 layer: its queries and head weights, and the compressor
    of its keys (``None`` on a layer that scores against another layer's keys, V4.1 sharing)."""

    w_q: torch.Tensor  # (D, Hi*di)
    w_weight: torch.Tensor  # (D, Hi)
    compressor: Compressor | None


@dataclass(frozen=True)
class EngramWeights:
    """The gate and value projection of one Engram layer (`adapters.model.engram`); its table
    is placed apart (`adapters.memory.engram_table`)."""

    w_key: torch.Tensor  # (K*dim, D)
    w_value: torch.Tensor  # (K*dim, D)
    hidden_norm: torch.Tensor  # (D,)
    key_norm: torch.Tensor  # (D,)


@dataclass(frozen=True)
class LayerWeights:
    ratio: int
    hc_attn: HyperConnection
    hc_ffn: HyperConnection
    attn_norm: torch.Tensor
    w_q: torch.Tensor  # (D, H*d)
    w_kv: torch.Tensor  # (D, d)
    kv_norm: torch.Tensor  # (d,)
    sink: torch.Tensor  # (H,)
    w_o: torch.Tensor  # (H*d, D)
    compressor: Compressor | None  # None: SWA-only, or a consumer of shared compressed KV
    indexer: Indexer | None  # None: not C4, or a C4 layer reusing another layer's selection
    ffn_norm: torch.Tensor
    w_gate: torch.Tensor  # (D, M)
    w_up: torch.Tensor  # (D, M)
    w_down: torch.Tensor  # (M, D)
    engram: EngramWeights | None = None  # an Engram layer's (ModelConfig.engram_layers)


@dataclass(frozen=True)
class MTPWeights:
    """The MTP layer (docs/speculative.md): RMSNorms of the previous hidden state and of the
    token embedding, a 2D -> D projection of their concatenation, one SWA-only block and a
    final norm; embedding and head are the main model's."""

    hidden_norm: torch.Tensor  # (D,)
    embed_norm: torch.Tensor  # (D,)
    proj: torch.Tensor  # (2D, D)
    layer: LayerWeights  # ratio 0
    final_norm: torch.Tensor  # (D,)


class ParallelHooks(Protocol):
    """What a forward over head-sharded weights does beyond one rank's maths."""

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """The attention's output projection summed over the ranks (before the residual
        merge)."""
        ...

    def keys(self, keys: Any) -> Any:
        """The `KeySource` the layers attend through (head padding around ``keys``)."""
        ...


@dataclass(frozen=True)
class ModelWeights:
    config: ModelConfig
    embed: torch.Tensor  # (V, D)
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    head: torch.Tensor  # (D, V)
    mtp: MTPWeights | None = None
    #: tensor parallelism's hooks, set by `adapters.distributed.tp.shard_weights` (``None``:
    #: one rank): every forward over these weights applies them (`model.final_hidden`)
    parallel: ParallelHooks | None = None

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype


class _Init:
    """Draws tensors from one seeded CPU generator, so weights do not depend on the device."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.dtype = device, dtype

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.gen, dtype=torch.float32) * std
        return t.to(self.device, self.dtype)

    def linear(self, fan_in: int, fan_out: int) -> torch.Tensor:
        return self.normal(fan_in, fan_out, std=fan_in**-0.5)

    def norm(self, dim: int) -> torch.Tensor:
        return (1.0 + self.normal(dim, std=0.05)).to(self.dtype)


def _hyper(init: _Init, cfg: ModelConfig) -> HyperConnection:
    s, sd = cfg.hc_streams, cfg.hc_streams * cfg.hidden
    return HyperConnection(
        w_pre=init.normal(sd, s, std=0.1 * sd**-0.5),
        w_post=init.normal(sd, s, std=0.1 * sd**-0.5),
        w_res=init.normal(sd, s * s, std=0.1 * sd**-0.5),
        b_pre=init.normal(s, std=0.5),
        b_post=init.normal(s, std=0.5),
        b_res=init.normal(s * s, std=1.0)
        + 2.0 * torch.eye(s, device=init.device).flatten().to(init.dtype),
        norm=init.norm(sd),
    )


def _compressor(init: _Init, cfg: ModelConfig, ratio: int, dim: int) -> Compressor:
    width = dim * (2 if cfg.is_overlap(ratio) else 1)
    return Compressor(
        w_kv=init.linear(cfg.hidden, width),
        w_gate=init.linear(cfg.hidden, width),
        ape=init.normal(ratio, width, std=0.5),
        norm=init.norm(dim),
    )


def _layer(init: _Init, cfg: ModelConfig, ratio: int) -> LayerWeights:
    d, h, hid = cfg.head_dim, cfg.num_heads, cfg.hidden
    indexer = None
    if ratio and cfg.is_sparse(ratio):
        indexer = Indexer(
            w_q=init.linear(hid, cfg.index_heads * cfg.index_dim),
            w_weight=init.linear(hid, cfg.index_heads),
            compressor=_compressor(init, cfg, ratio, cfg.index_dim),
        )
    return LayerWeights(
        ratio=ratio,
        hc_attn=_hyper(init, cfg),
        hc_ffn=_hyper(init, cfg),
        attn_norm=init.norm(hid),
        w_q=init.linear(hid, h * d),
        w_kv=init.linear(hid, d),
        kv_norm=init.norm(d),
        sink=init.normal(h, std=1.0),
        w_o=init.linear(h * d, hid),
        compressor=_compressor(init, cfg, ratio, d) if ratio else None,
        indexer=indexer,
        ffn_norm=init.norm(hid),
        w_gate=init.linear(hid, cfg.mlp_hidden),
        w_up=init.linear(hid, cfg.mlp_hidden),
        w_down=init.linear(cfg.mlp_hidden, hid),
    )


def _shared(cfg: ModelConfig, layer: int, lw: LayerWeights) -> LayerWeights:
    """Drops what ``layer`` does not compute under the config's sharing. Everything is drawn
    first, so every tensor a shared model keeps equals the unshared model's of the same seed."""
    if not lw.ratio:
        return lw
    source = cfg.kv_source_of(layer) == layer
    indexer = lw.indexer if cfg.runs_indexer(layer) else None
    if indexer is not None and not source:
        indexer = replace(indexer, compressor=None)
    return replace(lw, compressor=lw.compressor if source else None, indexer=indexer)


#: offset of the MTP layer's generator seed from the model's (its own stream of draws)
MTP_SEED_OFFSET = 0x4D5450
#: offset of the Engram projections' generator seed (the main weights stay those without)
ENGRAM_SEED_OFFSET = 0x454E52


def _engram(init: _Init, cfg: ModelConfig) -> EngramWeights:
    width = cfg.engram_lookups * cfg.engram_dim
    return EngramWeights(
        w_key=init.linear(width, cfg.hidden),
        w_value=init.normal(width, cfg.hidden, std=0.5 * width**-0.5),
        hidden_norm=init.norm(cfg.hidden),
        key_norm=init.norm(cfg.hidden),
    )


def _with_engram(cfg: ModelConfig, layers: tuple[LayerWeights, ...], device, dtype):
    """``layers`` with the Engram layers' projections, from a generator of their own."""
    if not cfg.engram_layers:
        return layers
    init = _Init(cfg.seed + ENGRAM_SEED_OFFSET, device, dtype)
    drawn = {i: _engram(init, cfg) for i in cfg.engram_layers}
    return tuple(replace(lw, engram=drawn.get(i)) for i, lw in enumerate(layers))


def _mtp(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> MTPWeights:
    init = _Init(cfg.seed + MTP_SEED_OFFSET, device, dtype)
    return MTPWeights(
        hidden_norm=init.norm(cfg.hidden),
        embed_norm=init.norm(cfg.hidden),
        proj=init.linear(2 * cfg.hidden, cfg.hidden),
        layer=_layer(init, cfg, 0),
        final_norm=init.norm(cfg.hidden),
    )


def init_weights(
    cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> ModelWeights:
    """Seeded random weights; the same ``cfg.seed`` gives the same values on every device. The
    MTP layer (``cfg.mtp``) and the Engram projections (``cfg.engram_layers``) draw from
    generators of their own: the main weights do not change."""
    init = _Init(cfg.seed, torch.device(device), dtype)
    embed = init.normal(cfg.vocab_size, cfg.hidden, std=1.0)
    layers = tuple(_shared(cfg, i, _layer(init, cfg, r)) for i, r in enumerate(cfg.compress_ratios))
    layers = _with_engram(cfg, layers, torch.device(device), dtype)
    return ModelWeights(
        config=cfg,
        embed=embed,
        layers=layers,
        final_norm=init.norm(cfg.hidden),
        head=init.linear(cfg.hidden, cfg.vocab_size),
        mtp=_mtp(cfg, torch.device(device), dtype) if cfg.mtp else None,
    )
