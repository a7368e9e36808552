"""Context-parallel prefill: one long prompt split round-robin over ``cp`` ranks.

Each rank runs the model's own layer skeleton (`adapters.model.model.forward`) over the tokens it
owns (`CPLayout`: chunks of ``chunk_len`` dealt round-robin), at their global positions. All the
position-local maths (mHC, projections, RoPE, the FFN, the compressor rows) is the same per
token, so only attention needs other ranks' data; `CPKeys` is the `KeySource` that fetches it:

* **SWA window**: a query's window ``(t - W, t]`` reaches up to ``W - 1`` positions before its
  chunk, held by earlier ranks: one point-to-point halo exchange of those latents per layer.
* **C4 (overlap + indexer)**: each rank compresses the groups whose rows are all its own; the
  group at a chunk start also pools the previous chunk's last group (the overlap). One
  all-gather per C4 layer carries every rank's finished entries and indexer keys *and* the raw
  rows of its boundary groups; every rank then pools the boundary entries itself and holds the
  whole prompt's entries and indexer keys at their global group indices, which the indexer's
  top-k over every visible position needs anyway.
* **C128 (dense, no overlap)**: no group crosses a chunk boundary and nothing pools across
  groups, so no rows travel; the all-gather carries only the finished entries (one per 128
  tokens) that later queries attend to.

Every query then sees exactly the keys, masks and shapes the dense reference builds
(`CPKeys` is a `DenseKeys` whose whole-sequence tensors are assembled over the group), so the
final-token logits equal cp = 1's: bit for bit in fp64 on CPU (docs/distributed.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from adapters.distributed.cp_comm import Comm
from adapters.distributed.cp_layout import CPLayout, CPLayoutError
from adapters.distributed.cp_plan import StreamPlan, WindowPlan, stream_plan, window_plan
from adapters.model import ops
from adapters.model.candidates import refuse_candidates
from adapters.model.model import LayerInput, compress_rows, forward
from adapters.model.model_config import ModelConfig
from adapters.model.reference import DenseKeys
from adapters.model.weights import Compressor, ModelWeights


class CPKeys(DenseKeys):
    """`KeySource` of one rank of a context-parallel prefill: the dense reference's attention
    (windows by position, entries by group, visibility, the indexer's top-k, V4.1 sharing)
    over tensors assembled through ``comm``. Every layer makes one `Comm.exchange` (the SWA
    halo) and every compressing layer one `Comm.all_gather`, on every rank in the same order.
    Holds the whole prompt's entries per KV-source layer (``entries``, ``index_keys``) and,
    for ``keep = (lo, hi)``, this rank's per-position state of ``[lo, hi)`` that a decode
    engine's pools hold (``kept``: window latents ``swa{i}``, in-flight rows ``kv_ring{i}`` /
    ``index_ring{i}``; rows of positions other ranks own are zero)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: CPLayout,
        comm: Comm,
        device: torch.device,
        keep: tuple[int, int] | None = None,
    ) -> None:
        refuse_candidates(cfg, "context-parallel prefill")
        super().__init__(cfg, layout.length)
        self.layout, self.comm, self.keep = layout, comm, keep
        self.kept: dict[str, torch.Tensor] = {}
        self.window_plan: WindowPlan = window_plan(layout, comm.rank, cfg.window, device)
        self.streams: dict[int, StreamPlan] = {
            r: stream_plan(layout, comm.rank, r, cfg.is_overlap(r), device) for r in cfg.ratios
        }

    def _keep(self, name: str, positions: torch.Tensor, rows: torch.Tensor) -> None:
        if self.keep is None:
            return
        lo, hi = self.keep
        mine = (positions >= lo) & (positions < hi)
        out = rows.new_zeros((hi - lo, rows.shape[1]))
        out[positions[mine] - lo] = rows[mine]
        self.kept[name] = out

    def _window(self, layer: LayerInput) -> tuple[torch.Tensor, torch.Tensor]:
        self._keep(f"swa{layer.index}", layer.positions, layer.kv)
        wp, kv = self.window_plan, layer.kv
        sends = {dst: kv[rows] for dst, rows in wp.sends.items()}
        got = self.comm.exchange(sends, wp.recv_rows, kv)
        halo = kv.new_zeros((wp.halo_len, kv.shape[1]))
        for src, rows in got.items():
            halo[wp.halo_index[src]] = rows
        return torch.cat((kv, halo))[wp.rows], wp.mask

    def _source_entries(self, layer: LayerInput) -> torch.Tensor:
        i, ratio, lw = layer.index, layer.weights.ratio, layer.weights
        source = self.cfg.kv_source_of(i)
        if source == i:
            assert lw.compressor is not None
            comps = [lw.compressor]
            if self.cfg.is_sparse(ratio):
                assert lw.indexer is not None and lw.indexer.compressor is not None
                comps.append(lw.indexer.compressor)
            made = self._gather_compressed(layer, comps, self.streams[ratio])
            self.entries[i] = made[0]
            if len(made) > 1:
                self.index_keys[i] = made[1]
        return self.entries[source]

    def _gather_compressed(
        self, layer: LayerInput, comps: list[Compressor], sp: StreamPlan
    ) -> list[torch.Tensor]:
        """The whole prompt's entries ``(G, dim)`` of each compressor in ``comps``, through
        one all-gather of every rank's entries and boundary rows."""
        parts, dims = [], []
        for comp, kind in zip(comps, ("kv", "index")):
            rows = ops.compressor_rows(layer.x, comp, layer.positions)
            self._keep(f"{kind}_ring{layer.index}", layer.positions, rows)
            dims.append((comp.norm.shape[0], rows.shape[1]))
            src = torch.cat((rows, _pad_row(rows)))
            ent = self._compress(src[sp.entry_src], sp, sp.entry_groups, comp, layer.x.dtype)
            parts += [ent.to(rows.dtype).flatten(), rows[sp.row_src].flatten()]
        size = max(sp.payload_len(q, dims) for q in range(self.comm.size))
        flat = torch.cat(parts)
        gathered = self.comm.all_gather(torch.cat((flat, flat.new_zeros(size - flat.numel()))))
        return [
            self._assemble(gathered, sp, dims, k, comp, layer.x.dtype)
            for k, comp in enumerate(comps)
        ]

    def _assemble(
        self,
        gathered: list[torch.Tensor],
        sp: StreamPlan,
        dims: list[tuple[int, int]],
        k: int,
        comp: Compressor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Compressor ``k``'s entries from every rank's part: their own groups placed at
        their global indices, the boundary groups pooled here from the shipped rows."""
        dim, width = dims[k]
        out = gathered[0].new_zeros((sp.num_groups, dim)).to(dtype)
        bank = []
        for q, part in enumerate(gathered):
            g = sp.ranks[q]
            at = sum(len(g.entry_groups) * d + len(g.row_groups) * sp.ratio * f
                     for d, f in dims[:k])  # fmt: skip
            n_ent, n_rows = len(g.entry_groups) * dim, len(g.row_groups) * sp.ratio * width
            out[sp.placed[q]] = part[at : at + n_ent].view(-1, dim).to(dtype)
            bank.append(part[at + n_ent : at + n_ent + n_rows].view(-1, sp.ratio, width))
        if sp.cross_groups.numel():
            rows = torch.cat(bank)
            src = torch.cat((rows[sp.cross_src[:, 0]], rows[sp.cross_src[:, 1]]), dim=1)
            out[sp.cross_groups] = self._compress(src, sp, sp.cross_groups, comp, dtype)
        return out

    def _compress(
        self,
        rows: torch.Tensor,
        sp: StreamPlan,
        groups: torch.Tensor,
        comp: Compressor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        ent = compress_rows(self.cfg, rows, sp.ratio, groups, comp.norm, self.cfg.rope_dim)
        return ent.to(dtype)


def _pad_row(rows: torch.Tensor) -> torch.Tensor:
    """The row before position 0 under the overlap: kv 0, score -inf."""
    pad = torch.zeros_like(rows[:1])
    pad[:, rows.shape[1] // 2 :] = float("-inf")
    return pad


@dataclass(frozen=True)
class CPPrefill:
    """One rank's result of `cp_prefill`."""

    logits: torch.Tensor  # (V,) the last prompt token's, the same on every rank
    positions: torch.Tensor  # (N,) the global positions this rank computed
    entries: dict[int, torch.Tensor]  # per KV-source layer: (G, dim) at global group indices
    index_keys: dict[int, torch.Tensor]  # per C4 KV-source layer: (G, index_dim)
    #: ``keep``'s positions ``[lo, hi)`` and their state from every rank (`CPKeys.kept`)
    kept: tuple[int, int] | None = None
    kept_rows: dict[str, torch.Tensor] | None = None
    #: SHA-256 of the prompt's token ids (int64), which a handoff checks against its tokens
    digest: str = ""


@torch.no_grad()
def cp_prefill(
    weights: ModelWeights,
    tokens: list[int] | torch.Tensor,
    chunk_len: int,
    comm: Comm,
    keep: tuple[int, int] | None = None,
) -> CPPrefill:
    """Prefills ``tokens`` over ``comm``'s ranks (every rank passes the same prompt and
    ``chunk_len``) and returns the last token's logits on every rank. ``keep = (lo, hi)``:
    also assemble, on every rank, the window latents and in-flight rows of positions
    ``[lo, hi)`` (one all-reduce: each position is one rank's, the others add zeros), what
    `cp_handoff.import_cp_prefill` writes into a decode engine's pools. Raises
    `CPLayoutError` before any communication if ``chunk_len`` is not a multiple of every
    compression ratio, or if some rank would own no chunk, and `ValueError` for a ``keep``
    outside the prompt."""
    cfg = weights.config
    ids = torch.as_tensor(tokens, dtype=torch.long, device=weights.device)
    layout = CPLayout.for_ratios(ids.shape[0], comm.size, chunk_len, cfg.ratios)
    if layout.num_chunks < layout.cp:
        raise CPLayoutError(
            f"{layout.num_chunks} chunks of {chunk_len} tokens for {layout.cp} ranks: "
            "every rank must own one"
        )
    if keep is not None:
        keep = (int(keep[0]), int(keep[1]))
        if not 0 <= keep[0] <= keep[1] <= layout.length:
            raise ValueError(f"keep={keep} is not a range of the {layout.length}-token prompt")
    pos = torch.from_numpy(layout.positions(comm.rank)).to(weights.device)
    keys = CPKeys(cfg, layout, comm, weights.device, keep)
    last = np.array([layout.length - 1])
    owner = int(layout.owner(last)[0])
    rows = [int(layout.local_row(last)[0])] if comm.rank == owner else []
    logits = forward(weights, ids[pos], pos, keys, torch.tensor(rows, dtype=torch.long))
    mine = logits[0] if rows else logits.new_zeros(logits.shape[1])
    kept = None
    if keep is not None:  # one all-reduce of every kept tensor, flattened
        names = sorted(keys.kept)
        flat = comm.all_reduce_sum(torch.cat([keys.kept[n].flatten() for n in names]))
        sizes = [keys.kept[n].numel() for n in names]
        kept = {n: part.view_as(keys.kept[n])
                for n, part in zip(names, torch.split(flat, sizes))}  # fmt: skip
    logits = comm.broadcast(mine, owner)
    return CPPrefill(logits, pos, keys.entries, keys.index_keys, keep, kept, token_digest(ids))


def token_digest(tokens: list[int] | torch.Tensor) -> str:
    """SHA-256 of token ids as int64 bytes (what ties a `CPPrefill` to its prompt)."""
    ids = torch.as_tensor(tokens, dtype=torch.long).cpu().numpy()
    return hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest()
