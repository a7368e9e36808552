"""`PoolRows`: the table arithmetic every sparse kernel reads through, and its validation."""

from __future__ import annotations

import pytest
import torch

from adapters.kernels.rows import PoolRows


def test_slot_and_page_tables_address_the_same_rows() -> None:
    """A page table with 4 slots per page reads the slots ``page * 4 + g % 4``; a slot table
    listing those slots reads the same rows; ``slots_of`` looks up only selected rows."""
    pages = torch.tensor([[3, 0, 5], [1, 2, 4]])
    lengths = torch.tensor([5, 12])
    by_page = PoolRows(pages, lengths, None, 4, width=10)
    slots = by_page.slots()
    assert slots.shape == (2, 10)
    assert slots[0].tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 20, 21]
    by_slot = PoolRows(slots, lengths)
    assert torch.equal(by_slot.slots(), slots)
    picks = torch.tensor([[9, 0], [4, 7]])
    assert torch.equal(by_page.slots_of(picks), torch.gather(slots, 1, picks))
    assert by_page.mask().sum(1).tolist() == [5, 10]  # lengths past the width read the width


def test_shared_rows_select_queries() -> None:
    table = torch.arange(8).view(2, 4)
    rows = PoolRows(table, torch.tensor([1, 2, 3]), torch.tensor([1, 1, 0]))
    assert rows.slots().tolist() == [[4, 5, 6, 7], [4, 5, 6, 7], [0, 1, 2, 3]]
    part = rows.select(slice(1, 3))
    assert part.num_queries == 2 and part.slots().tolist() == [[4, 5, 6, 7], [0, 1, 2, 3]]
    own = PoolRows(table, torch.tensor([1, 2])).select(slice(1, 2))
    assert own.slots().tolist() == [[4, 5, 6, 7]]


def test_of_tables_takes_the_page_table_first() -> None:
    lengths = torch.tensor([2, 1])
    pages = torch.tensor([[2], [0]])
    rows = PoolRows.of_tables(pages, None, lengths, 4, 4, None)
    assert rows.slots_per_page == 4 and rows.lengths.tolist() == [2, 1] and rows.num_rows == 4
    slots = torch.arange(8).view(2, 4)
    by_slot = PoolRows.of_tables(None, slots, lengths, 3, 4, None)
    assert by_slot.slots_per_page == 1 and by_slot.num_rows == 3
    with pytest.raises(ValueError, match="table"):
        PoolRows.of_tables(None, None, lengths, 4, 4, None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(table=torch.zeros(2, dtype=torch.long), lengths=torch.zeros(2)), "table must be"),
        (dict(slots_per_page=0), "slots_per_page"),
        (dict(width=9), "exceeds"),
        (dict(lengths=torch.zeros(3, dtype=torch.long)), "one row per query"),
        (dict(qrow=torch.zeros(3, dtype=torch.long)), "qrow must be"),
    ],
)
def test_bad_rows_are_refused(kwargs: dict, match: str) -> None:
    args = dict(table=torch.zeros(2, 4, dtype=torch.long), lengths=torch.zeros(2, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PoolRows(**args)
