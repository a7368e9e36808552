"""Decode bucket sizes: a graph step runs at a (batch, context) bucket, captured once as a CUDA
graph; every request of the step is padded to it."""

from __future__ import annotations


def power_bucket(n: int, lo: int) -> int:
    """The least power of two >= ``n``, at least ``lo`` (batch buckets)."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


#: Context buckets per octave above 1,024 tokens: a step's entry columns (and with them the
#: indexer's, the top-k's and C128 attention's work, which follow the bucket, not the live
#: lengths) exceed the longest request by at most 1/8 instead of up to 2x (a 1,048,640-token
#: batch ran 2,097,152 columns' worth). Each bucket is one more captured graph.
CONTEXT_BUCKET_STEPS = 8


def context_bucket(n: int, lo: int, hi: int) -> int:
    """The decode context a step of longest request ``n`` runs at: at least ``lo``, at most
    ``hi``; a multiple ``m * 2**j`` (``m`` in ``[8, 16)``) of ``2**j >= 128`` (every ratio's
    group size divides it) when that is finer than the power of two."""
    fine = 1 << max((max(n, 1) - 1).bit_length() - CONTEXT_BUCKET_STEPS.bit_length(), 0)
    if fine < 128:
        return min(power_bucket(n, lo), hi)
    return min(max(lo, -(-n // fine) * fine), hi)
