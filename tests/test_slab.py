"""ExtentAllocator: exact reuse, alignment, coalescing, exhaustion and bookkeeping invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvstore_client.errors import InvalidArgument, ResourceExhausted

from tiers.slab import ExtentAllocator

KIB = 1024
MIB = 1 << 20


def test_offsets_are_aligned_and_sizes_rounded():
    a = ExtentAllocator(1 * MIB)
    offs = [a.alloc(n) for n in (1, 4095, 4096, 4097, 10_000)]
    assert all(o % 4096 == 0 for o in offs)
    assert [a.size_of(o) for o in offs] == [4096, 4096, 4096, 8192, 12288]
    assert a.used_bytes == 4096 * 3 + 8192 + 12288
    assert len(set(offs)) == len(offs)


def test_custom_alignment():
    a = ExtentAllocator(64 * KIB, align=256)
    assert a.alloc(1) == 0
    assert a.alloc(300) == 256
    assert a.size_of(256) == 512
    with pytest.raises(InvalidArgument, match="power of two"):
        ExtentAllocator(64 * KIB, align=3000)


def test_equal_size_reuses_exact_extent():
    a = ExtentAllocator(16 * MIB)
    blocks = [a.alloc(2 * MIB) for _ in range(4)]
    a.free(blocks[2])
    assert a.alloc(2 * MIB) == blocks[2]          # not bump, not a split of something else
    small = a.alloc(4096)
    assert small == 8 * MIB                       # bump: the freed 2 MiB slot was reused above
    a.free(blocks[0])
    a.free(blocks[1])
    assert {a.alloc(2 * MIB), a.alloc(2 * MIB)} == {blocks[0], blocks[1]}


def test_exhaustion_raises_resource_exhausted():
    a = ExtentAllocator(8 * MIB)
    offs = [a.alloc(2 * MIB) for _ in range(4)]
    with pytest.raises(ResourceExhausted, match="slab full"):
        a.alloc(1)
    a.free(offs[1])
    with pytest.raises(ResourceExhausted):
        a.alloc(2 * MIB + 1)                      # 3 MiB round-up does not fit a 2 MiB hole
    assert a.alloc(2 * MIB) == offs[1]


def test_coalescing_makes_room_for_a_larger_extent():
    a = ExtentAllocator(8 * MIB)
    offs = [a.alloc(1 * MIB) for _ in range(8)]
    for o in offs[2:6]:                           # four adjacent 1 MiB holes in the middle
        a.free(o)
    big = a.alloc(4 * MIB)
    assert big == offs[2]
    assert a.used_bytes == 8 * MIB


def test_coalescing_returns_tail_to_bump_region_and_splits_remainder():
    a = ExtentAllocator(4 * MIB)
    offs = [a.alloc(1 * MIB) for _ in range(4)]
    for o in offs[1:]:
        a.free(o)
    assert a.alloc(2 * MIB) == 1 * MIB            # three free MiBs merged; 2 MiB carved off
    assert a.alloc(1 * MIB) == 3 * MIB
    with pytest.raises(ResourceExhausted):
        a.alloc(4096)


def test_split_of_larger_free_extent():
    a = ExtentAllocator(3 * MIB)
    x = a.alloc(2 * MIB)
    a.alloc(1 * MIB)
    a.free(x)
    assert a.alloc(4096) == 0                     # best fit: split the 2 MiB hole
    assert a.alloc(2 * MIB - 4096) == 4096


def test_double_free_and_unknown_offset():
    a = ExtentAllocator(1 * MIB)
    o = a.alloc(100)
    a.free(o)
    with pytest.raises(InvalidArgument, match="already freed"):
        a.free(o)
    with pytest.raises(InvalidArgument, match="not an allocated extent"):
        a.free(12345)
    with pytest.raises(InvalidArgument):
        a.size_of(o)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4096", True])
def test_bad_sizes(bad):
    with pytest.raises(InvalidArgument, match="positive integer"):
        ExtentAllocator(1 * MIB).alloc(bad)


ops = st.lists(
    st.one_of(st.tuples(st.just("alloc"), st.sampled_from([1, 4096, 5000, 8192, 65536, 200_000])),
              st.tuples(st.just("free"), st.integers(0, 1000))),
    max_size=200)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_sequences_keep_invariants(seq):
    cap = 1 * MIB
    a = ExtentAllocator(cap)
    live: dict[int, int] = {}
    for op, arg in seq:
        if op == "alloc":
            try:
                off = a.alloc(arg)
            except ResourceExhausted:
                # must be genuinely impossible: no contiguous aligned gap of that size
                need = a.round(arg)
                ends = sorted((o, o + s) for o, s in live.items())
                gaps, prev = [], 0
                for s, e in ends:
                    gaps.append(s - prev)
                    prev = e
                gaps.append(cap - prev)
                assert max(gaps) < need
                continue
            assert off % 4096 == 0 and a.size_of(off) >= arg
            live[off] = a.size_of(off)
        elif live:
            off = sorted(live)[arg % len(live)]
            a.free(off)
            del live[off]
        spans = sorted((o, o + s) for o, s in live.items())
        assert all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:], strict=False))
        assert all(e <= cap for _, e in spans)
        assert a.used_bytes == sum(live.values())


def test_churned_pool_reuses_oldest_freed_first():
    """After heavy churn (the pattern that made the old free list quadratic) every allocation
    still takes the oldest free extent of its size, and the accounting stays exact."""
    a = ExtentAllocator(1 << 30, 4096)
    offs = [a.alloc(8192) for _ in range(20_000)]
    freed = offs[::2]
    for o in freed:
        a.free(o)
    assert a.used_bytes == 10_000 * 8192
    again = [a.alloc(8192) for _ in range(10_000)]
    assert again == freed
    assert a.used_bytes == 20_000 * 8192


def _churned(n_free: int) -> tuple[ExtentAllocator, list[int]]:
    """A 16-slot allocator whose first n_free slots (freed out of order) wait in the bucket."""
    a = ExtentAllocator(16 * 64 * KIB)
    offs = [a.alloc(64 * KIB) for _ in range(8)]
    for o in [offs[3], offs[0], offs[5], offs[1]][:n_free]:
        a.free(o)
    return a, offs


@pytest.mark.parametrize("n", [0, 2, 4, 7, 10])
def test_alloc_many_takes_what_n_allocs_would(n):
    """Freed extents first, oldest freed first, then the bump region: the same offsets, in
    the same order, and the same state after, as n alloc() calls."""
    one, _ = _churned(4)
    many, _ = _churned(4)
    want = [one.alloc(64 * KIB) for _ in range(n)]
    assert many.alloc_many(64 * KIB, n) == want
    assert many.used_bytes == one.used_bytes
    assert [many.alloc(64 * KIB) for _ in range(2)] == [one.alloc(64 * KIB) for _ in range(2)]


def test_alloc_many_is_all_or_none():
    a, _ = _churned(4)
    used = a.used_bytes
    with pytest.raises(ResourceExhausted):
        a.alloc_many(64 * KIB, 13)            # 4 freed + 8 never used: one short
    assert a.used_bytes == used
    assert len(a.alloc_many(64 * KIB, 12)) == 12
    with pytest.raises(InvalidArgument):
        a.alloc_many(64 * KIB, -1)
