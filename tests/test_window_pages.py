"""Window-page arithmetic (issue #13): each named formula of `shadowradix.slots` that the core
uses for the SWA pages of a window equals a brute-force definition over positions, for every
length, window and page size in a small range (ints and NumPy int64 arrays alike)."""

from __future__ import annotations

from itertools import count

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from shadowradix import slots

PAGE = st.sampled_from([1, 2, 4, 8, 16])
WINDOW = st.integers(1, 40)
LENGTH = st.integers(0, 80)


def _first_page_meeting(start: int, page_size: int) -> int:
    """The first page holding a position ``>= start`` (page 0 when ``start <= 0``)."""
    return next(k for k in count() if (k + 1) * page_size > start)


def _window_pages(length: int, window: int, page_size: int) -> set[int]:
    """Pages holding a position of ``[length - window, length)``, cut at the start of the page
    holding ``length`` (the window's pages before that one)."""
    cut = max(b for b in range(0, length + 1, page_size))
    return {pos // page_size for pos in range(max(0, length - window), cut)}


def _as_array(f, *args):
    """``f`` over a NumPy int64 array of the first argument (with ``xp``), as ints."""
    return int(f(np.array([args[0]], dtype=np.int64), *args[1:], xp=np)[0])


@given(LENGTH, PAGE)
def test_page_start_and_num_pages(length, p) -> None:
    assert slots.page_start(length, p) == max(b for b in range(0, length + 1, p))
    assert slots.num_pages(length, p) == next(n for n in count() if n * p >= length)
    assert slots.num_pages(length, p) == len({pos // p for pos in range(length)})


@given(LENGTH, WINDOW, PAGE)
def test_window_first_page(length, w, p) -> None:
    want = _first_page_meeting(length - w, p)
    assert slots.window_first_page(length, w, p) == want
    assert _as_array(slots.window_first_page, length, w, p) == want
    if length:  # the window's first position lies on that page
        assert max(0, length - w) // p == want


@given(LENGTH, WINDOW, PAGE)
def test_window_num_pages(length, w, p) -> None:
    want = len(_window_pages(length, w, p))
    assert slots.window_num_pages(length, w, p) == want
    assert _as_array(slots.window_num_pages, length, w, p) == want


@given(LENGTH, WINDOW, PAGE)
def test_held_window_first_page(computed, w, p) -> None:
    boundary = max(b for b in range(0, computed + 1, p))  # F
    want = _first_page_meeting(boundary - w, p)
    assert slots.held_window_first_page(computed, w, p) == want
    assert _as_array(slots.held_window_first_page, computed, w, p) == want
    # holding from there keeps the whole window before F, and nothing before that window
    held = set(range(want, boundary // p))
    assert _window_pages(boundary, w, p) == held


@given(WINDOW, PAGE)
def test_tail_window_pages(w, p) -> None:
    # the pages the last ``w`` tokens before any page boundary meet
    for end in range(w, w + 3 * p):
        boundary = end // p * p
        if boundary >= w:
            got = {pos // p for pos in range(boundary - w, boundary)}
            assert slots.tail_window_pages(w, p) == len(got)
