"""The CUDA caching allocator model (trainer/estimate/allocator.py): torch's rules, case by case."""

from __future__ import annotations

from trainer.estimate.allocator import CachingAllocator, round_size, segment_size

MiB = 1 << 20


def test_requests_round_to_512_bytes_and_segments_by_pool() -> None:
    assert [round_size(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB  # the small pool's segment
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB  # kLargeBuffer
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 1) == 12 * MiB  # rounded to 2 MiB


def test_small_requests_share_a_segment_and_large_ones_do_not_use_it() -> None:
    a = CachingAllocator()
    for key in range(4):
        a.malloc(key, 256 * 1024)
    assert a.reserved == 2 * MiB  # four 256 KiB blocks out of one 2 MiB segment
    a.malloc(4, 2 * MiB)  # the small pool's free 1 MiB is not the large pool's
    assert a.reserved == 22 * MiB


def test_freed_blocks_are_reused_best_fit_and_merged_with_free_neighbours() -> None:
    a = CachingAllocator()
    a.malloc(0, 12 * MiB)
    a.malloc(1, 16 * MiB)
    a.free(0)
    a.free(1)
    a.malloc(2, 11 * MiB)  # best fit: the 12 MiB block, not the 16 MiB one
    a.malloc(3, 15 * MiB)
    assert a.reserved == 28 * MiB
    a.free(2)
    a.free(3)
    a.malloc(4, 3 * MiB)  # from the smallest free block, split: 9 MiB stays cached in that segment
    a.malloc(5, 9 * MiB)
    assert a.reserved == 28 * MiB
    a.free(4)
    a.free(5)
    a.malloc(6, 12 * MiB)  # the 3 and 9 MiB pieces merged back into the 12 MiB segment
    assert a.reserved == a.peak_reserved == 28 * MiB


def test_a_remainder_of_at_most_1_mib_is_not_split_off_a_large_block() -> None:
    a = CachingAllocator()
    a.malloc(0, 12 * MiB)
    a.free(0)
    a.malloc(1, 11 * MiB)  # 1 MiB would remain: the whole 12 MiB block is handed out
    a.malloc(2, MiB + 512)  # so this needs a new 20 MiB segment
    assert a.reserved == 32 * MiB
    a.free(1)
    a.free(2)
    a.malloc(3, 10 * MiB + 512 * 1024)  # 1.5 MiB remains of the 12 MiB block: split
    a.malloc(4, MiB + 512)  # served from that 1.5 MiB remainder (best fit), not from the 20 MiB segment
    assert a.reserved == a.peak_reserved == 32 * MiB


def test_fragmentation_reserves_more_than_is_live() -> None:
    """Requests of 10 MiB and more get a segment each: the freed middle one stays cached, and a 20 MiB request
    cannot use it."""
    a = CachingAllocator()
    for key in range(3):
        a.malloc(key, 10 * MiB)
    a.free(1)
    a.malloc(3, 20 * MiB)
    assert a.reserved == 50 * MiB  # 40 MiB live
    a.free(0)
    a.free(2)
    a.free(3)
    assert a.peak_reserved == 50 * MiB and a.reserved == 50 * MiB  # segments are kept
