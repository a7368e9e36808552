"""The LRU index's integer heap keys order exactly as the tuples they stand for."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shadowradix.lru import ID_BITS, full_key, is_full_key, swa_key

_stamp = st.integers(0, 2**62 - 1)
_id = st.integers(0, 2**ID_BITS - 1)
_swa = st.tuples(st.integers(0, 1), _stamp, _id)


@given(st.tuples(_stamp, _id), st.tuples(_stamp, _id))
def test_full_keys_order_as_stamp_then_id(a, b):
    assert (full_key(*a) < full_key(*b)) == (a < b)
    assert (full_key(*a) == full_key(*b)) == (a == b)


@given(_swa, _swa)
def test_swa_keys_order_as_tier_stamp_then_id(a, b):
    assert (swa_key(*a) < swa_key(*b)) == (a < b)
    assert (swa_key(*a) == swa_key(*b)) == (a == b)


@given(st.tuples(_stamp, _id), _swa)
def test_a_full_key_is_never_an_swa_key(f, s):
    assert is_full_key(full_key(*f)) and not is_full_key(swa_key(*s))
    assert full_key(*f) < swa_key(*s)
