"""The daemon's collector policy: survivors of a full collection are frozen (later full
collections walk only new objects); after ``thaw_every_s`` they are handed back, and a
reference cycle made among them is then collected."""

import gc
import weakref

from tierstore.daemon.gcpolicy import FreezeAfterFullCollections


class _Node:
    def __init__(self):
        self.other = None


def _cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_full_collection_freezes_its_survivors_and_a_thaw_lets_cycles_among_them_go():
    policy = FreezeAfterFullCollections(thaw_every_s=3600)
    was_frozen = gc.get_freeze_count()
    policy.install()
    try:
        keep = [_Node() for _ in range(1000)]
        gc.collect()
        assert policy.full_collections >= 1
        assert gc.get_freeze_count() >= was_frozen + len(keep)
        # a cycle whose objects were frozen is not found while they stay frozen ...
        a = _Node()
        a.other = _Node()
        a.other.other = a
        gone = weakref.ref(a)
        gc.collect()  # (frozen now)
        del a
        gc.collect()
        assert gone() is not None
        # ... and is once the thaw hands them back
        policy.thaw_every_s = 0
        gc.collect()  # thaws at its end
        assert policy.thaws == 1
        policy.thaw_every_s = 3600
        gc.collect()
        assert gone() is None
        # a cycle made after a thaw and dropped before the next full collection goes too
        ref = _cycle()
        gc.collect()
        assert ref() is None
        del keep
    finally:
        policy.uninstall()
        gc.unfreeze()
    assert policy._after not in gc.callbacks


def test_free_heap_goes_back_to_the_system():
    """After many freed C-heap allocations, ``release_free_heap`` returns their pages:
    the process's anonymous memory shrinks (glibc, as here)."""
    import gc

    from tierstore.daemon.gcpolicy import release_free_heap

    def rss_anon() -> int:
        with open("/proc/self/status") as f:
            return int(f.read().split("RssAnon:")[1].split()[0]) * 1024

    keep = []
    blobs = []
    for i in range(40000):
        blobs.append(bytearray(2000))  # C-heap (over pymalloc's 512 bytes)
        if i % 1000 == 999:
            keep.append(bytearray(2000))  # a few survivors, so the heap's top is not simply cut
    blobs.clear()
    gc.collect()
    before = rss_anon()
    assert release_free_heap()
    assert rss_anon() < before - 40 * (1 << 20)
    del keep
