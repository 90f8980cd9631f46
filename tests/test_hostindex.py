"""The host-tier index log in shared memory: replay, torn appends, compaction."""

import os

from tierstore.hostindex import HostIndexLog


def _rec(i, off):
    return [i, 1, "ns", f"k{i}", "torch", "float32", [4], 16, off, False, None]


def test_replay_compaction_and_torn_tail():
    log = HostIndexLog(size=4096 + 2 * 8192)  # tiny halves: compaction happens often
    log.start_empty()
    live = {}
    for i in range(2000):
        live[i] = _rec(i, i * 4096)
        log.append_host(live[i], lambda: list(live.values()))
        if i % 3 == 0:
            log.append_drop(i, lambda: list(live.values()))
            del live[i]
        if len(live) > 40:  # keep the live set small enough for one half
            j = min(live)
            log.append_drop(j, lambda: list(live.values()))
            del live[j]
    again = HostIndexLog(fd=__import__("os").dup(log.fd))
    assert sorted(r[0] for r in again.replay()) == sorted(live)
    # a torn append: a length whose payload never fully arrived is ignored
    tail = again._tail
    again.mm[tail:tail + 8] = (100).to_bytes(4, "little") + (12345).to_bytes(4, "little")
    third = HostIndexLog(fd=__import__("os").dup(log.fd))
    assert sorted(r[0] for r in third.replay()) == sorted(live)
    for x in (log, again, third):
        x.close()


def test_adoption_of_a_replaced_object_whose_drop_never_made_it_frees_its_block(tmp_path):
    """The host index holds an object and the newer one that replaced it under the same key,
    but not the older one's drop (the daemon died in between): the newer is adopted and the
    older one's block goes back to the allocator, not held until the next restart."""
    import numpy as np

    from tierstore import Config, Store

    cfg = Config(host_bytes=8 << 20, nvme_dirs=[str(tmp_path)], nvme_bytes=64 << 20)
    with Store(cfg) as s:
        s.daemon.enable_host_index()
        s.put(np.full(100_000, 1, np.uint8), key="k")
        old = s.hostlog.replay()
        s.put(np.full(100_000, 2, np.uint8), key="k", replace=True)  # the replacement; its drop of the old follows
        new = [r for r in s.hostlog.replay() if r not in old]
        arena_fd = os.dup(s.arena.fd)
    assert len(old) == 1 and len(new) == 1
    log = HostIndexLog()
    log.start_empty()
    for rec in old + new:  # the old one's add and the new one's, no drop
        log.append_host(rec, lambda: [])
    try:
        with Store(cfg, inherited_fds={"arena": arena_fd, "index": os.dup(log.fd)}) as s:
            assert s.replay_info["adopted"] == 1
            h = s.lookup("k")
            assert (s.get(h) == 2).all()
            s.free(h)
            assert s.stat()["tiers"]["host"]["used_bytes"] == 0
    finally:
        log.close()


def test_a_live_set_larger_than_a_half_abandons_the_log_instead_of_failing_appends(caplog):
    """More host-resident objects than a half can describe: appends go on (a put must not
    fail for the restart log), the log says once that it stopped, and a daemon handed the
    memfd finds no log and adopts nothing rather than a partial set."""
    log = HostIndexLog(size=4096 + 2 * 8192)
    log.start_empty()
    live = {}
    for i in range(400):  # ~400 records of ~40 bytes: twice what one 8 KiB half holds
        live[i] = _rec(i, i * 4096)
        log.append_host(live[i], lambda: list(live.values()))
    assert log.abandoned
    assert sum("cannot hold the host tier's live set" in r.message for r in caplog.records) == 1
    log.append_drop(3, lambda: list(live.values()))  # still no error
    log.rewrite(list(live.values()))
    handed = HostIndexLog(fd=os.dup(log.fd))
    assert handed.replay() == []
    for x in (log, handed):
        x.close()


def test_the_log_is_sized_for_every_block_of_the_host_tier():
    from tierstore.hostindex import INDEX_BYTES, index_bytes_for

    assert index_bytes_for(1 << 20) == INDEX_BYTES  # small tiers: the floor
    big = index_bytes_for(16 << 30)  # 4 Mi pages: a record of 256 bytes each fits in a half
    assert (big - 4096) // 2 >= (16 << 30) // 4096 * 256
