"""Which attention blocks a rank computes (pure): its queries against the keys that came from rank `source`.

With the head-tail split (sequence.py) rank i holds chunks (i, 2w-1-i) of 2w. Under causal attention:
- source i: its own keys, the causal square (local order is ascending, so the plain causal mask is right);
- source j < i: every query sees key chunk j whole and none of chunk 2w-1-j (it lies after 2w-1-i):
  all queries x the first half of the keys, unmasked;
- source j > i: chunk i sees neither of j's chunks; chunk 2w-1-i sees both whole:
  the second half of the queries x all keys, unmasked.
Every off-diagonal block is half a square, so every rank does the same work. Without load balancing,
sources j < i are full squares and j > i are skipped. Without a causal mask every block is full.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Half(enum.Enum):
    ALL = "all"
    FIRST = "first"
    SECOND = "second"

    def select(self, length: int) -> slice:
        """The index range of this half of a local sequence of `length`."""
        half = length // 2
        return {Half.ALL: slice(0, length), Half.FIRST: slice(0, half), Half.SECOND: slice(half, length)}[self]


@dataclass(frozen=True)
class Block:
    """One kernel call: which half of the queries against which half of the keys, with or without the mask."""

    causal: bool  # the square causal mask (only the diagonal block); else unmasked
    queries: Half
    keys: Half


def attention_block(rank: int, source: int, *, causal: bool, load_balance: bool) -> Block | None:
    """The block of rank `rank`'s queries against rank `source`'s keys; None when the mask zeroes it."""
    if not causal:
        return Block(False, Half.ALL, Half.ALL)
    if source == rank:
        return Block(True, Half.ALL, Half.ALL)
    if not load_balance:
        return Block(False, Half.ALL, Half.ALL) if source < rank else None
    return Block(False, Half.ALL, Half.FIRST) if source < rank else Block(False, Half.SECOND, Half.ALL)


def ring_sources(rank: int, cp: int) -> list[int]:
    """The rank whose keys a rank holds at each ring step: its own, then its predecessor's, and so on
    (each step passes K/V to the next rank)."""
    return [(rank - step) % cp for step in range(cp)]


def block_pairs(block: Block, local_len: int) -> int:
    """Query-key pairs the block computes (its work)."""
    q = block.queries.select(local_len)
    k = block.keys.select(local_len)
    nq, nk = q.stop - q.start, k.stop - k.start
    return nq * (nq + 1) // 2 if block.causal else nq * nk
