"""Which gradients travel together: pure bucket assignment, as torch's DDP reducer computes it.

Gradients are listed in the order they are expected to become ready (the reverse of the parameters'
definition order at first, the order observed in backward once it has run). Walking that list, a bucket
collects tensors of one kind (dtype and device: a bucket is one flat buffer) until it holds at least its
limit; the first bucket of each kind closes at `first_cap_bytes` (small, so the first all-reduce starts
early in backward), the later ones at `cap_bytes`. Buckets are returned in the order they fill up, which is
the order they are all-reduced in.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

MIB = 1024 * 1024
FIRST_BUCKET_BYTES = 1 * MIB  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES


def assign_buckets(
    nbytes: Sequence[int], kinds: Sequence[Hashable], *, cap_bytes: int, first_cap_bytes: int = FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """Positions 0..n-1 of the tensors (sizes `nbytes`, buffer kinds `kinds`) grouped into buckets, each
    list in the given order, the buckets ordered by their first position (when they start filling)."""
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be positive, got cap {cap_bytes} and first cap {first_cap_bytes} bytes")
    open_buckets: dict[Hashable, list[int]] = {}
    sizes: dict[Hashable, int] = {}
    closed_per_kind: dict[Hashable, int] = {}
    done: list[list[int]] = []
    for i, (size, kind) in enumerate(zip(nbytes, kinds, strict=True)):
        bucket = open_buckets.setdefault(kind, [])
        bucket.append(i)
        sizes[kind] = sizes.get(kind, 0) + size
        limit = first_cap_bytes if closed_per_kind.get(kind, 0) == 0 else cap_bytes
        if sizes[kind] >= limit:
            done.append(bucket)
            closed_per_kind[kind] = closed_per_kind.get(kind, 0) + 1
            del open_buckets[kind]
            sizes[kind] = 0
    done += [b for b in open_buckets.values() if b]
    return sorted(done, key=lambda b: b[0])
