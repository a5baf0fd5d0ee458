"""A model of torch's CUDA caching allocator, replayed on a step's allocations: the memory it reserves.

torchtitan (and `nvidia-smi`) report the allocator's reserved peak, not live tensor bytes: the allocator
carves tensors out of cached segments and keeps freed blocks for reuse, so it holds more than is live.
`CachingAllocator` follows c10/cuda/CUDACachingAllocator.cpp's native allocator with its defaults (one
stream, no `expandable_segments`, no `max_split_size_mb`, no `roundup_power2_divisions`):

    a request is rounded up to 512 bytes;
    requests up to 1 MiB come from the small pool, larger ones from the large pool;
    the best-fitting cached free block of the pool serves it (smallest that is large enough), split when
    what remains is at least 512 bytes (small pool) or over 1 MiB (large pool), else handed out whole;
    with no block large enough a new segment is reserved: 2 MiB for a small request, 20 MiB for one under
    10 MiB, else the request rounded up to 2 MiB;
    a freed block merges with its free neighbours in its segment; segments are never given back (the
    allocator releases its cache only when a reservation fails, i.e. near the device's capacity).

Live bytes (`estimate_memory`) say what must fit; the reserved peak says what torch will show.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


def round_size(nbytes: int) -> int:
    return MIN_BLOCK * max(1, -(-nbytes // MIN_BLOCK))


def segment_size(nbytes: int) -> int:
    """The bytes reserved for a new segment serving a (rounded) request of `nbytes`."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-nbytes // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    @property
    def key(self) -> tuple[int, int, int]:  # best fit: by size, then address, as the allocator's block set
        return (self.size, self.segment, self.offset)


class CachingAllocator:
    """Replays `malloc(key, nbytes)` / `free(key)`; `reserved` and `peak_reserved` are its segments' bytes."""

    def __init__(self) -> None:
        self.reserved = 0
        self.peak_reserved = 0
        self._segments = 0
        self._pools: dict[bool, tuple[list[tuple[int, int, int]], dict[tuple[int, int, int], _Block]]] = {
            True: ([], {}),
            False: ([], {}),
        }
        self._allocated: dict[int, _Block] = {}

    def reset_peak(self) -> None:
        """Measure the peak from here; the segments reserved so far stay reserved (cached)."""
        self.peak_reserved = self.reserved

    def malloc(self, key: int, nbytes: int) -> None:
        if nbytes <= 0:  # CUDA's allocator hands out no memory for an empty tensor
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small)
        if block is None:
            block = _Block(self._segments, 0, segment_size(size), small)
            self._segments += 1
            self.reserved += block.size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):
            rest = _Block(block.segment, block.offset + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.free = False
        self._allocated[key] = block

    def free(self, key: int) -> None:
        block = self._allocated.pop(key, None)
        if block is None:
            return
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                if neighbour is block.prev:
                    block.offset, block.prev = neighbour.offset, neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.size += neighbour.size
        self._insert(block)

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        keys, blocks = self._pools[small]
        i = bisect.bisect_left(keys, (size, -1, -1))
        if i == len(keys):
            return None
        return blocks.pop(keys.pop(i))

    def _insert(self, block: _Block) -> None:
        keys, blocks = self._pools[block.small]
        bisect.insort(keys, block.key)
        blocks[block.key] = block

    def _remove(self, block: _Block) -> None:
        keys, blocks = self._pools[block.small]
        keys.pop(bisect.bisect_left(keys, block.key))
        del blocks[block.key]
