"""Fingerprint oracle: simulated physical pools that remember what each slot should hold.

Every slot an `Allocation` hands out is "written" with a fingerprint of what a from-scratch
computation would put there: (pool, hash of the token prefix up to the position). Every read
through a `ReadPlan`, and every in-flight row a completing group consumes, must find exactly
that fingerprint. Cache reuse is then indistinguishable from recomputation, ring rows included.
Bounded-replay writes are marked approximate and may only be read by the request that replayed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from .. import slots
from ..config import CacheConfig
from ..results import Allocation, ReadPlan, StreamWrites


class OracleViolation(AssertionError):
    """A slot holds something recomputation would not have produced."""


@dataclass(frozen=True)
class Fingerprint:
    prefix_hash: int
    approx_writer: int | None = None  # request id of a bounded-replay write


def prefix_hashes(tokens: list[int]) -> list[int]:
    """``h[i]`` fingerprints ``tokens[: i + 1]`` (rolling, so O(len))."""
    out, h = [], 0x5EED
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class FingerprintOracle:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.swa: dict[int, Fingerprint] = {}
        self.rings: dict[int, dict[int, Fingerprint]] = {r: {} for r in config.ratios}
        self.entries: dict[int, dict[int, Fingerprint]] = {r: {} for r in config.ratios}
        self.reads = 0

    def write(
        self,
        allocation: Allocation,
        tokens_by_request: dict[int, list[int]],
        approximate: Collection[int] = (),
    ) -> None:
        """Apply an allocation; ``tokens_by_request`` holds each request's full token list.

        Writes of a replay, and of the requests in ``approximate`` (whose state derives from a
        replay), are marked approximate: only approximate readers may read them."""
        hashes = {rid: prefix_hashes(tokens_by_request[rid]) for rid in allocation.request_ids}
        offsets = allocation.token_offsets
        approx = {
            rid: rid if allocation.replay or rid in approximate else None
            for rid in allocation.request_ids
        }
        for i, rid in enumerate(allocation.request_ids):
            h = hashes[rid]
            sl = slice(offsets[i], offsets[i + 1])
            for pos, slot in zip(
                allocation.positions[sl].tolist(), allocation.swa_slots[sl].tolist()
            ):
                self.swa[slot] = Fingerprint(h[pos], approx[rid])
        for s in allocation.streams:
            self._write_stream(s, allocation, hashes, approx)

    def _write_stream(
        self,
        s: StreamWrites,
        allocation: Allocation,
        hashes: dict[int, list[int]],
        approx: dict[int, int | None],
    ) -> None:
        rids = allocation.request_ids
        ring = self.rings[s.ratio]
        # 1. groups completing now read carry rows written by earlier steps
        for req, pos, row in zip(
            s.carry_request.tolist(), s.carry_positions.tolist(), s.carry_rows.tolist()
        ):
            rid = rids[req]
            self._expect(
                ring.get(row),
                hashes[rid][pos],
                rid,
                approx[rid] is not None or None,
                f"C{s.ratio} carry row {row} (pos {pos})",
            )
        self._check_group_inputs(s, allocation)
        # 2. store the in-flight rows worth keeping: no two may collide within one step
        if len(set(s.ring_rows.tolist())) != len(s.ring_rows):
            raise OracleViolation(f"C{s.ratio}: two positions write one ring row in the same step")
        for req, pos, row in zip(
            s.ring_request.tolist(), s.ring_positions.tolist(), s.ring_rows.tolist()
        ):
            ring[row] = Fingerprint(hashes[rids[req]][pos], approx[rids[req]])
        # 3. completed entries
        r = s.ratio
        for req, g, slot in zip(
            s.entry_request.tolist(), s.entry_groups.tolist(), s.entry_slots.tolist()
        ):
            self.entries[r][slot] = Fingerprint(
                hashes[rids[req]][slots.group_end(g, r)], approx[rids[req]]
            )

    def _check_group_inputs(self, s, allocation: Allocation) -> None:
        """Each completed group's rows are either carried in or computed in this step."""
        stream = self.config.stream(s.ratio)
        r = s.ratio
        carried: dict[int, set[int]] = {}
        for req, pos in zip(s.carry_request.tolist(), s.carry_positions.tolist()):
            carried.setdefault(req, set()).add(pos)
        offsets = allocation.token_offsets
        for req, g in zip(s.entry_request.tolist(), s.entry_groups.tolist()):
            first_new = int(allocation.positions[offsets[req]])
            lo = slots.clamp_low(slots.group_first(g, r, stream.overlap))
            needed = set(range(lo, min(first_new, slots.group_end(g, r) + 1)))
            if not needed <= carried.get(req, set()):
                raise OracleViolation(
                    f"C{r} group {g}: in-flight rows {sorted(needed)} not carried in"
                )

    def move_pages(self, full_src, full_dst, swa_src, swa_dst) -> None:
        """A rebalance's page moves (`relocation.PageMoves`), as the adapter's row copies:
        each moved page's SWA slots and ring rows (SWA pages) or compressed entries (virtual
        pages) go to the new page; what the source held is gone."""
        p = self.config.page_size
        _move(self.swa, swa_src, swa_dst, p)
        for s in self.config.streams:
            _move(self.rings[s.ratio], swa_src, swa_dst, s.ring_len)
            _move(self.entries[s.ratio], full_src, full_dst, s.slots_per_page)

    def check_reads(
        self,
        plan: ReadPlan,
        tokens: list[int],
        request_id: int,
        approximate: bool | None = None,
    ) -> None:
        """Every slot a forward at ``plan.length`` would read holds recomputation's value.

        ``approximate``: whether the reader knows its state derives from a replay (then it may
        read approximate writes); ``None``: only the approximate writer itself may read them."""
        h = prefix_hashes(tokens[: plan.length])
        rid, ok = request_id, approximate
        for pos, slot in zip(plan.swa_positions.tolist(), plan.swa_slots.tolist()):
            self._expect(self.swa.get(slot), h[pos], rid, ok, f"SWA slot {slot} (pos {pos})")
        for s in plan.streams:
            r = s.ratio
            for g, slot in enumerate(s.entry_slots.tolist()):
                self._expect(
                    self.entries[r].get(slot), h[slots.group_end(g, r)], rid, ok, f"C{r} entry {g}"
                )
            for pos, row in zip(s.inflight_positions.tolist(), s.inflight_rows.tolist()):
                self._expect(self.rings[r].get(row), h[pos], rid, ok, f"C{r} ring row {row}")
        self.reads += 1

    @staticmethod
    def _expect(
        found: Fingerprint | None,
        expected: int,
        reader: int,
        reader_approximate: bool | None,
        what: str,
    ) -> None:
        if found is None or found.prefix_hash != expected:
            raise OracleViolation(f"{what}: holds {found}, recomputation gives {expected}")
        if found.approx_writer is None or found.approx_writer == reader or reader_approximate:
            return
        raise OracleViolation(
            f"{what}: request {reader} reads replay-derived state of request "
            f"{found.approx_writer} without being flagged approximate"
        )


def _move(rows: dict[int, Fingerprint], src, dst, per_page: int) -> None:
    """Rows ``[s * per_page, (s + 1) * per_page)`` of each source page to its target page."""
    taken = {}
    for a, b in zip(src, dst):
        for k in range(per_page):
            taken[b * per_page + k] = rows.pop(a * per_page + k, None)
    for slot, fp in taken.items():
        if fp is None:
            rows.pop(slot, None)
        else:
            rows[slot] = fp
