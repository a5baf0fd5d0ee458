"""Weighted mixing of several document streams (`training.dataset_weights`): which source fills each row.

Row n of the run (row j of global batch k is n = k * G + j) is filled from the source whose slice of [0, 1)
holds u_n = frac(n / phi + offset(seed)), the slices laid end to end in the order of the paths, each as wide
as its normalized weight. u_n is a Weyl sequence: by the three-distance theorem the golden ratio spreads it
more evenly than any other rotation, so over N rows each source's count is within a few times log(N) of
weight x N (a seeded random choice would be off by ~sqrt(N)), and every row's source is a function of
(weights, seed, n) alone, computable for any position without replaying the run: resuming and every dp
degree see the same choices. Every row is seq_len + 1 tokens, so shares of rows are shares of tokens.
The arithmetic is exact integer arithmetic modulo 2^64: no float drift at large n.
"""

from __future__ import annotations

from bisect import bisect_right

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / phi, rounded to odd


def _offset(seed: int) -> int:
    """splitmix64 of the seed: nearby seeds start the sequence far apart."""
    z = (seed * _GOLDEN + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def slice_bounds(weights: list[float]) -> list[int]:
    """Each source's upper end in [0, 2^64], cumulative; a zero weight has an empty slice (never chosen)."""
    total = sum(weights)
    bounds, acc = [], 0.0
    for w in weights:
        acc += w
        bounds.append(round(acc / total * (1 << 64)))
    bounds[-1] = 1 << 64  # the last slice ends at 1 exactly, whatever the float rounding
    return bounds


def row_sources(bounds: list[int], seed: int, first_row: int, count: int) -> list[int]:
    """The source index of rows first_row, ..., first_row + count - 1 (`bounds` from `slice_bounds`)."""
    offset = _offset(seed)
    return [bisect_right(bounds, (n * _GOLDEN + offset) & _MASK) for n in range(first_row, first_row + count)]
