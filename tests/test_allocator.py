import random

import numpy as np
import pytest

from tierstore.allocator import ExtentAllocator


def test_alignment_and_accounting():
    a = ExtentAllocator(1 << 20)
    offs = [a.alloc(n) for n in (1, 4095, 4096, 4097, 10000)]
    assert all(o % 4096 == 0 for o in offs)
    assert a.used_bytes == 4096 * (1 + 1 + 1 + 2 + 3)
    assert len(set(offs)) == 5


def test_coalescing_recovers_one_extent():
    a = ExtentAllocator(64 * 4096)
    offs = [a.alloc(4096) for _ in range(64)]
    assert a.alloc(1) is None
    random.Random(1).shuffle(offs)
    for o in offs:
        a.free(o, 4096)
    assert a.free_extents() == [(0, 64 * 4096)]
    assert a.alloc(64 * 4096) == 0


def test_fragmentation_does_not_strand_space():
    a = ExtentAllocator(1 << 20)
    small = [a.alloc(4096) for _ in range(256)]
    for o in small[::2]:
        a.free(o, 4096)
    assert a.alloc(8192) is None  # genuinely fragmented
    for o in small[1::2]:
        a.free(o, 4096)
    assert a.alloc(1 << 20) == 0


def test_double_free_and_bad_free_rejected():
    a = ExtentAllocator(1 << 20)
    o = a.alloc(4096)
    a.free(o, 4096)
    with pytest.raises(ValueError, match="double free"):
        a.free(o, 4096)
    with pytest.raises(ValueError, match="outside"):
        a.free(1 << 20, 4096)


def test_reserve_for_replay():
    a = ExtentAllocator(1 << 20)
    a.reserve(8192, 4096)
    assert a.used_bytes == 4096
    with pytest.raises(ValueError, match="not free"):
        a.reserve(8192, 4096)
    assert a.alloc(8192) == 0
    assert a.alloc(4096) == 12288


def test_random_workload_matches_model():
    rng = random.Random(7)
    a = ExtentAllocator(4 << 20)
    live = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            o = rng.choice(list(live))
            a.free(o, live.pop(o))
        else:
            n = rng.randint(1, 64 * 1024)
            o = a.alloc(n)
            if o is not None:
                live[o] = n
        spans = sorted((o, a.rounded(n)) for o, n in live.items())
        for (o1, n1), (o2, _) in zip(spans, spans[1:]):
            assert o1 + n1 <= o2
        assert a.used_bytes == sum(a.rounded(n) for n in live.values())


def test_small_blocks_from_the_top_keep_big_holes_whole():
    cap = 64 * 4096
    for small_bytes, expect_whole in ((0, False), (8 * 4096, True)):
        a = ExtentAllocator(cap, small_bytes=small_bytes)
        big, small = [], []
        for _ in range(6):  # interleaved: 8-page objects and 1-page scalars
            big.append(a.alloc(8 * 4096))
            small.append(a.alloc(100))
        for o in big:
            a.free(o, 8 * 4096)
        # the big objects went: with small blocks kept at the top, their space is one hole
        assert (a.largest_free >= 48 * 4096) is expect_whole
        assert a.free_bytes == cap - 6 * 4096
        assert all(o >= cap - 6 * 4096 for o in small) is expect_whole
        for o in small:
            a.free(o, 100)
        assert a.free_extents() == [(0, cap)]


def test_small_blocks_fall_back_to_any_hole_that_fits():
    a = ExtentAllocator(16 * 4096, small_bytes=8 * 4096)
    big = a.alloc(12 * 4096)
    tops = [a.alloc(4096) for _ in range(4)]
    assert tops == [15 * 4096, 14 * 4096, 13 * 4096, 12 * 4096] and a.alloc(1) is None
    a.free(big, 12 * 4096)
    assert a.alloc(3 * 4096) == 9 * 4096  # topmost hole that fits, carved from its end


def test_a_fenced_extent_is_not_handed_out_again_until_its_owner_goes():
    page = 4096
    a = ExtentAllocator(16 * page)
    x, y, z = a.alloc(4 * page), a.alloc(4 * page), a.alloc(4 * page)
    a.fence("stalled", x + page, 100)  # part of x: the whole of x is held back
    a.fence("other", y, 4 * page)
    a.free(x, 4 * page)
    a.free(y, 4 * page)
    a.free(z, 4 * page)  # not fenced: free at once
    assert a.held_bytes == 8 * page and a.used_bytes == 8 * page and a.free_bytes == 8 * page
    with pytest.raises(ValueError, match="double free"):
        a.free(x, 4 * page)
    got = [a.alloc(page) for _ in range(9)]
    assert got.count(None) == 1  # only z's 4 pages and the 4 never used
    assert not any(o is not None and x <= o < y + 4 * page for o in got)
    for o in got:
        if o is not None:
            a.free(o, page)
    assert a.unfence("nobody") == 0
    assert a.unfence("stalled") == 4 * page and a.held_bytes == 4 * page  # y stays held by "other"
    assert a.alloc(4 * page) == x
    a.free(x, 4 * page)
    assert a.unfence("other") == 4 * page
    assert a.held_bytes == 0 and a.used_bytes == 0 and a.free_extents() == [(0, 16 * page)]


def _columns(extents):
    return np.array([o for o, _ in extents], np.int64), np.array([n for _, n in extents], np.int64)


@pytest.mark.parametrize("seed", range(40))
def test_reserving_many_at_once_equals_reserving_one_by_one(seed):
    """Replay reserves every live object's extents in one pass (``reserve_arrays``): the
    free lists and counts it leaves are those of ``reserve`` called extent by extent, and an
    extent that is not free, or two that overlap, refuse the whole list and change nothing."""
    rng = random.Random(seed)
    cap = 4096 * rng.randint(1, 300)
    one, many = ExtentAllocator(cap), ExtentAllocator(cap)
    for _ in range(rng.randint(0, 12)):  # the same fragmented start for both
        n = rng.randint(1, 5 * 4096)
        assert one.alloc(n) == many.alloc(n)
    extents = []
    for start, size in one.free_extents():
        pos = start
        while pos < start + size:
            step = 4096 * rng.randint(1, max(1, min(3, (start + size - pos) // 4096)))
            if rng.random() < 0.6:
                extents.append((pos, step - rng.randint(0, 4095)))
            pos += step
    rng.shuffle(extents)
    before = (many.free_extents(), many.used_bytes, many.largest_free)
    if extents and rng.random() < 0.3:
        bad = rng.choice([extents[0], (extents[0][0] + 4096 * cap, 1), (cap, 1)])
        with pytest.raises(ValueError):
            many.reserve_arrays(*_columns(sorted(extents + [bad])))
        assert (many.free_extents(), many.used_bytes, many.largest_free) == before
    for off, n in extents:
        one.reserve(off, n)
    many.reserve_arrays(*_columns(sorted(extents)))
    assert many.free_extents() == one.free_extents() and many.used_bytes == one.used_bytes
    assert many.largest_free == one.largest_free
    assert [many.alloc(4096) for _ in range(3)] == [one.alloc(4096) for _ in range(3)]


def test_a_run_is_adjacent_extents_taken_at_once_and_freed_one_by_one():
    a = ExtentAllocator(64 * 4096)
    offs = a.alloc_run([16, 4096, 5000, 1])
    assert offs is not None and len(offs) == 4
    assert [b - o for o, b in zip(offs, offs[1:])] == [4096, 4096, 8192]  # each its rounded size, adjacent
    assert a.used_bytes == 5 * 4096
    for o, n in zip(offs, [16, 4096, 5000, 1]):
        a.free(o, n)
    assert a.used_bytes == 0 and a.free_extents() == [(0, 64 * 4096)]


def test_a_run_that_no_free_extent_holds_takes_nothing():
    a = ExtentAllocator(16 * 4096)
    blocks = [a.alloc(4096) for _ in range(16)]
    for o in blocks[::2]:
        a.free(o, 4096)  # 8 free pages, none adjacent
    used = a.used_bytes
    assert a.alloc_run([4096, 4096]) is None and a.used_bytes == used
    assert a.alloc_run([4096]) is not None and a.alloc_run([]) is None


def test_nvme_alloc_many_takes_small_objects_as_one_run_and_falls_back_one_by_one(tmp_path):
    from tierstore.engine import select_engine
    from tierstore.errors import CapacityExceeded
    from tierstore.nvme import NvmeTier

    tier = NvmeTier([str(tmp_path)], 64 * 4096, select_engine("posix", 2), direct_io="off", grow_bytes=4096)
    try:
        got = tier.alloc_many([16, 4096, 8192])
        assert [len(e) for e in got] == [1, 1, 1]
        starts = [e[0].file_offset for e in got]
        assert starts == [starts[0], starts[0] + 4096, starts[0] + 8192]
        assert tier.used_bytes == 4 * 4096
        # the data file grew once, to the run's end
        assert tier.drives[0].file_size >= starts[0] + 16384
        # fragmented: no extent holds the run, so one by one; what does not fit fails alone
        rest = tier.alloc_many([4096] * 60)
        assert all(isinstance(e, list) for e in rest)
        for e in rest[::2]:
            tier.free(e)
        later = tier.alloc_many([4096, 4096, 8192])
        assert [type(e) for e in later] == [list, list, CapacityExceeded]
    finally:
        tier.close()


def test_nvme_write_many_counts_each_byte_written_once(tmp_path):
    """``bytes_written`` (``stat``'s NVMe bytes) counts what reached the data file: small
    objects written in one run and larger ones written one by one, each once."""
    import os

    from tierstore.engine import select_engine
    from tierstore.nvme import NvmeTier

    tier = NvmeTier([str(tmp_path)], 64 << 20, select_engine("posix", 2), direct_io="off", grow_bytes=1 << 20)
    try:
        sizes = [100, 4096, 3 << 20, 5000]
        srcs = [np.full(n, i + 1, np.uint8) for i, n in enumerate(sizes)]
        exts = tier.alloc_many(sizes)
        crcs = tier.write_many([(e, s, None) for e, s in zip(exts, srcs)])
        assert not any(isinstance(c, Exception) for c in crcs)
        assert tier.bytes_written == sum(sizes)
        for e, s, c in zip(exts, srcs, crcs):
            back = np.empty(s.nbytes, np.uint8)
            tier.read(e, back, c)
            assert np.array_equal(back, s)
        assert os.path.getsize(tier.drives[0].path) >= max(x[0].file_offset for x in exts)
    finally:
        tier.close()
