"""The host-tier index log in shared memory: replay, torn appends, compaction."""

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
