"""The prefetcher and trace-driven eviction, with the real store and the real engine."""

import signal
import subprocess
import sys
import threading

import pytest
import torch
from conftest import poll_until

OBJ = 512 * 1024  # bytes per object


def _cyclic_store(make_store, policy, prefetch, n_objs=32, host="8MiB", budget="2MiB"):
    s = make_store(host_bytes=host, policy=policy, prefetch=prefetch, prefetch_budget_bytes=budget,
                   high_watermark=1.0, low_watermark=0.9)
    hs = [s.put(torch.full((OBJ // 4,), float(i)), key=f"p{i}", tier="nvme") for i in range(n_objs)]
    return s, hs


def _fetches_after_each_access(s):
    """Hold the prefetcher's fetches until the access that queued them has checked in:
    which object a fetch pushes out then no longer depends on whether its worker ran
    before or after the check-in (a leased object cannot be chosen). Returns the gate
    ``_run_steps`` closes around each access."""
    gate = threading.Event()
    gate.set()
    fetch = s.placement.fetch

    def gated(oid):
        assert gate.wait(30), "the gate stayed closed"
        return fetch(oid)

    s.placement.fetch = gated
    return gate


def _run_steps(s, order, steps, check=None, gate=None):
    """One access per object in ``order`` per step; returns the per-step hit fractions."""
    rates = []
    for _ in range(steps):
        before = s.stat()["prefetch"]
        for i, h in order:
            if gate is not None:
                gate.clear()
            with s.checkout(h, "r") as v:
                assert v[0].item() == float(i)
            if gate is not None:
                gate.set()
            if check:
                check()
            s.wait_prefetch(timeout_s=30)  # compute at least as long as the fetch: prefetch is never late
        s.step()
        after = s.stat()["prefetch"]
        n = sum(after[k] - before[k] for k in ("hits", "late", "misses"))
        rates.append((after["hits"] - before["hits"]) / n)
    return rates


def test_trace_reaches_95_percent_where_lru_collapses(make_store):
    s, hs = _cyclic_store(make_store, "trace", True)  # working set 16 MiB = 2x the host tier
    rates = _run_steps(s, list(enumerate(hs)), 6)
    assert min(rates[2:]) >= 0.95, rates
    st = s.stat()["prefetch"]
    assert st["traces"][0]["state"] == "learned" and st["prefetched_bytes"] > 0
    s.close()
    lru, hs = _cyclic_store(make_store, "lru", False)
    rates_lru = _run_steps(lru, list(enumerate(hs)), 4)
    assert max(rates_lru[1:]) < 0.10, rates_lru  # the LRU collapse on a cyclic pattern


def test_the_head_of_the_step_stays_resident(make_store):
    """A tier too small for the loop does not rotate the head of the step: its first
    objects are not evicted right after use (plain Belady does, as the object just used
    is the one needed furthest away, and it must then be read back at the wrap with no
    compute before it)."""
    s = make_store(host_bytes="8MiB", policy="trace", prefetch=True, prefetch_budget_bytes="2MiB",
                   high_watermark=1.0, low_watermark=0.9)
    hs = [s.put(torch.full((OBJ // 4,), float(i)), key=f"p{i}") for i in range(32)]  # room for 16
    order = list(enumerate(hs))
    _run_steps(s, order, 3)
    seen = []

    def check():
        seen.append(all("host" in s.info(hs[i])["residency"] for i in range(4)))

    _run_steps(s, order, 3, check=check)
    assert all(seen), seen.count(False)
    assert min(_run_steps(s, order, 1)) >= 0.95


def test_the_rotation_is_spread_over_the_step(make_store):
    """A tier too small for the loop rotates objects spread over the step, not one
    stretch of it: the objects that leave the tier during a step (and are read back)
    are spread over the step after its head, so the disk reads and writes back at about
    the step's average rate everywhere. The head stays resident.

    Which objects leave is a function of the access order alone here: one prefetch read
    at a time (concurrent reads would pick their victims in whatever order their
    workers run), each finished before the next access (wait_prefetch), and the
    background demoter never woken (high_watermark 1.0)."""
    s = make_store(host_bytes="12MiB", policy="trace", prefetch=True, prefetch_budget_bytes="2MiB",
                   prefetch_max_inflight=1, high_watermark=1.0, low_watermark=0.9)
    hs = [s.put(torch.full((OBJ // 4,), float(i)), key=f"p{i}") for i in range(32)]  # room for 24
    order = list(enumerate(hs))
    gate = _fetches_after_each_access(s)
    _run_steps(s, order, 3, gate=gate)
    for _ in range(2):
        rotated = set()

        def check():
            rotated.update(i for i in range(32) if "host" not in s.info(hs[i])["residency"])

        assert min(_run_steps(s, order, 1, check=check, gate=gate)) >= 0.95
        assert len(rotated) >= 8 and min(rotated) >= 4, sorted(rotated)  # the head (the budget's 4) stays
        # in one stretch, any 8 consecutive accesses there would all be read back
        assert max(len(rotated & set(range(a, a + 8))) for a in range(4, 25)) <= 5, sorted(rotated)


def test_an_object_larger_than_half_the_budget_stays_resident(make_store):
    """An object that would fill most of the prefetcher's reach is not rotated while
    smaller ones can be: there is not enough compute in front of it to hide its read
    (here it is the step's last access, which a "latest in the step first" order would
    rotate every step)."""
    s = make_store(host_bytes="8MiB", policy="trace", prefetch=True, prefetch_budget_bytes="2MiB",
                   high_watermark=1.0, low_watermark=0.9)
    hs = [s.put(torch.full((OBJ // 4,), float(i)), key=f"p{i}") for i in range(24)]
    hs.append(s.put(torch.full((3 * OBJ // 4,), 24.0), key="big"))  # 1.5 MiB of a 2 MiB budget
    order = list(enumerate(hs))
    _run_steps(s, order, 3)
    seen = []

    def check():
        seen.append("host" in s.info(hs[-1])["residency"])

    rates = _run_steps(s, order, 3, check=check)
    assert all(seen), seen.count(False)
    assert min(rates) >= 0.95, rates


def test_the_heads_of_two_interleaved_loops_stay_resident(make_store):
    """The same with two learned traces (two streams, as two ranks of a job are): when
    a step ends, the first objects of the next step of both loops are resident."""
    s = make_store(host_bytes="8MiB", policy="trace", prefetch=True, prefetch_budget_bytes="1MiB",
                   high_watermark=1.0, low_watermark=0.9)
    hs = {st: [s.put(torch.full((OBJ // 4,), float(i)), key=f"{st}{i}") for i in range(16)] for st in "ab"}
    missing = []
    for step in range(7):
        for i in range(16):
            for st in "ab":
                with s.checkout(hs[st][i], "r", stream=st) as v:
                    assert v[0].item() == float(i)
                s.wait_prefetch(timeout_s=30)
        if step >= 3:
            missing += [f"{x}{j}" for x in "ab" for j in range(2) if "host" not in s.info(hs[x][j])["residency"]]
        s.step()
    traces = s.stat()["prefetch"]["traces"]
    assert len(traces) == 2 and all(t["state"] == "learned" for t in traces)
    assert not missing, missing


@pytest.mark.parametrize("chunk", [4096, 64, 65])
def test_reach_is_the_budgets_worth_of_accesses(make_store, monkeypatch, chunk):
    """The prefetcher's reach (a binary search in running byte sums, built a chunk at a
    time) equals walking the upcoming accesses until their bytes exceed the budget, at
    every cursor position, across chunk boundaries too."""
    import random

    from tierstore import prefetch

    monkeypatch.setattr(prefetch, "_CHUNK", chunk)
    rng = random.Random(3)
    s = make_store(host_bytes="64MiB", policy="trace", prefetch=True, prefetch_budget_bytes="300KiB")
    hs = [s.put(torch.zeros(rng.choice([1, 1000, 20000, 40000, 90000]))) for _ in range(40)]
    order = [rng.randrange(40) for _ in range(120)]
    for _ in range(2):
        for i in order:
            s.get(hs[i])
        s.step()
    trace = s.prefetcher.book.learned_traces()[0]
    sizes = [s.info(hs[i])["nbytes"] for i in order]
    budget = s.config.prefetch_budget_bytes
    for i in order:
        s.get(hs[i])
        total, want = 0, min(64, len(order))
        for k in range(min(64, len(order))):
            total += sizes[(trace.cursor + 1 + k) % len(order)]
            if total > budget:
                want = max(k, 1)
                break
        assert s.prefetcher.reach(trace) == want
    built = s.prefetcher._sums[id(trace)][2]
    assert len(built) <= 2 * len(order) // chunk + 1


def test_an_owners_step_records_a_bounded_number_of_accesses(monkeypatch):
    """However many accesses one owner makes in a step, over however many streams, its
    traces record at most ``MAX_STEP_ACCESSES`` of them (the rest only move the cursor);
    another owner's budget is its own, and a step starts a fresh one."""
    from tierstore import trace as tmod

    monkeypatch.setattr(tmod, "MAX_STEP_ACCESSES", 100)
    book = tmod.TraceBook()
    for i in range(300):
        book.record("a", f"s{i % 3}", i)
        book.record("b", "s", i % 50)
    assert sum(len(t.current) for t in book.of("a")) == 100 and book.pending("b") == 100
    book.step("a")
    assert book.pending("a") == 100  # the step just closed, kept to compare the next with
    for i in range(100):
        book.record("a", "s0", i)
    assert len(book.get("a", "s0").current) == 100


def test_learned_orders_are_bounded_all_owners_together():
    """An order that would take every learned order past ``max_learned`` positions is not
    learned (counted in ``over_budget``); an owner going away gives its positions back."""
    from tierstore.trace import TraceBook

    book = TraceBook(max_learned=150)
    for owner in ("a", "b"):
        for _step in range(2):
            for i in range(100):
                book.record(owner, "s", i)
            book.step(owner)
    assert book.get("a", "s").state == "learned" and book.get("b", "s").state == "learning"
    assert book.learned_total == 100 and book.over_budget == 1
    v = book.version
    book.record("c", "s", 1)
    book.drop("c")  # learned nothing: no learned order changed (the eviction policy's index stands)
    assert book.version == v
    book.drop("a")
    assert book.learned_total == 0 and book.version == v + 1
    for i in range(100):
        book.record("b", "s", i)
    book.step("b")
    assert book.get("b", "s").state == "learned" and book.learned_total == 100


def test_a_long_step_is_compared_off_the_daemons_event_loop(make_store):
    """The daemon's loop steps a short trace itself; a step whose comparison covers more
    than ``INLINE_STEP`` accesses is ``Later`` (an op worker compares it, without the
    store's lock held) and learns the same order."""
    from tierstore.hints import INLINE_STEP
    from tierstore.waits import Later

    s = make_store(host_bytes="64MiB", policy="trace", prefetch=True)
    hs = [s.put(torch.zeros(4)) for _ in range(100)]

    def access(owner, h):
        with s.index.cv:
            s.prefetcher.record(owner, "default", h.id, "hit", 0.0)
    owner = object()
    for _ in range(2):
        for h in hs:
            access(owner, h)
        assert s.daemon.try_step(owner) is None
    small = s.prefetcher.book.get(owner, "default")
    assert small.state == "learned" and len(small.learned) == 100
    big = object()
    n = INLINE_STEP // len(hs) + 1
    for step in range(2):
        for _ in range(n):
            for h in hs:
                access(big, h)
        later = s.daemon.try_step(big)
        assert isinstance(later, Later)
        later.run()
    t = s.prefetcher.book.get(big, "default")
    assert t.state == "learned" and len(t.learned) == n * len(hs) and s.counters["steps"] == 4


def test_an_object_evicted_after_the_scan_passed_it_is_fetched_again(make_store):
    """The prefetcher looks at each upcoming access once; an object it passed as resident
    and that is then moved down is queued again at the next access."""
    s = make_store(host_bytes="64MiB", policy="trace", prefetch=True, prefetch_budget_bytes="3MiB")
    hs = [s.put(torch.full((OBJ // 4,), float(i)), key=f"p{i}") for i in range(8)]  # all resident
    for _ in range(2):
        for h in hs:
            s.get(h)
        s.step()
    s.get(hs[0])  # the scan passes p1..p5 (resident) within its 3 MiB reach
    meta = s.index.objects[hs[3].id]
    with s.index.cv:
        meta.moving = True
    s.placement.demote(meta)
    assert "host" not in s.info(hs[3])["residency"]
    s.get(hs[1])
    assert s.wait_prefetch(10)
    assert "host" in s.info(hs[3])["residency"]
    before = s.stat()["prefetch"]
    s.get(hs[2])
    s.get(hs[3])
    after = s.stat()["prefetch"]
    assert after["hits"] - before["hits"] == 2 and after["misses"] == before["misses"]


def test_changed_loop_order_is_relearned(make_store):
    s, hs = _cyclic_store(make_store, "trace", True)
    order = list(enumerate(hs))
    _run_steps(s, order, 3)
    rev = order[::-1]
    rates = _run_steps(s, rev, 4)
    assert min(rates[2:]) >= 0.95, rates
    t = s.stat()["prefetch"]["traces"][0]
    assert t["relearned"] >= 1 and t["state"] == "learned"


def test_small_changes_keep_the_trace(make_store):
    s, hs = _cyclic_store(make_store, "trace", True)
    order = list(enumerate(hs))
    _run_steps(s, order, 3)
    skipped = order[:10] + order[11:]  # a layer skipped
    rates = _run_steps(s, skipped, 2)
    assert min(rates) >= 0.9, rates
    assert s.stat()["prefetch"]["traces"][0]["relearned"] == 0


def test_leased_objects_are_never_evicted(make_store):
    s, hs = _cyclic_store(make_store, "trace", True)
    held = [s.checkout(hs[i], "r") for i in (3, 17)]
    ptrs = [lease.tensor.data_ptr() for lease in held]

    def check():
        for i, lease in zip((3, 17), held):
            assert "host" in s.info(hs[i])["residency"]
            assert lease.tensor.data_ptr() == ptrs[0 if i == 3 else 1] and lease.tensor[0].item() == float(i)

    order = [(i, h) for i, h in enumerate(hs) if i not in (3, 17)]
    _run_steps(s, order, 4, check=check)
    for lease in held:
        lease.release()


def test_prefetch_never_exceeds_its_budget(make_store):
    budget = 3 * OBJ
    s, hs = _cyclic_store(make_store, "trace", True, budget=budget)
    seen = []

    def check():
        p = s.prefetcher
        with s.index.cv:
            seen.append(p.queued_bytes + p.protected_bytes)
            assert p.queued_bytes + p.protected_bytes <= budget

    _run_steps(s, list(enumerate(hs)), 4, check=check)
    assert max(seen) > 0


def test_lru_with_prefetch_and_explicit_hints(make_store):
    s, hs = _cyclic_store(make_store, "lru", True, n_objs=8, host="16MiB")
    assert s.prefetch_tracked(hs[:4]).result(timeout=30) == 4
    assert all("host" in s.info(h)["residency"] for h in hs[:4])
    st = s.stat()["prefetch"]
    assert st["prefetched_bytes"] == 4 * OBJ and st["queued"] == 0


def test_a_hint_longer_than_the_in_flight_limit_is_fetched_whole_within_the_budget(make_store):
    """A hint's objects past the in-flight limit wait for a slot (not dropped); past the
    budget, until the prefetched ones are used."""
    s = make_store(host_bytes="16MiB", policy="lru", prefetch=True, prefetch_budget_bytes=str(3 * OBJ),
                   prefetch_max_inflight=1, high_watermark=1.0, low_watermark=0.9)
    hs = [s.put(torch.full((OBJ // 4,), float(i)), key=f"p{i}", tier="nvme") for i in range(6)]
    assert s.prefetch_tracked(hs).result(timeout=30) == 3  # one at a time, up to the budget's three
    st = s.stat()["prefetch"]
    assert st["prefetched_bytes"] == 3 * OBJ and st["protected_bytes"] == 3 * OBJ and st["hinted"] == 3
    assert ["host" in s.info(h)["residency"] for h in hs] == [True] * 3 + [False] * 3
    for i, h in enumerate(hs[:3]):  # using them frees the budget: the rest of the hint follows
        with s.checkout(h, "r") as v:
            assert v[0].item() == float(i)
    assert s.wait_prefetch(timeout_s=30)
    st = s.stat()["prefetch"]
    assert st["hits"] == 3 and st["prefetched_bytes"] == 6 * OBJ and st["hinted"] == 0
    assert all("host" in s.info(h)["residency"] for h in hs[3:])
    # an object larger than the whole budget is skipped, not left blocking the hints behind it
    big = s.put(torch.zeros(OBJ), key="big", tier="nvme")  # 4 x OBJ bytes
    rest = [s.put(torch.full((OBJ // 4,), 9.0), key=f"q{i}", tier="nvme") for i in range(2)]
    for h in hs[3:]:
        with s.checkout(h, "r"):
            pass
    assert s.prefetch_tracked([big, *rest]).result(timeout=30) == 2
    assert s.stat()["prefetch"]["hinted"] == 0 and "host" not in s.info(big)["residency"]


CLIENT = r"""
import sys, torch
from tierstore.client import Client
c = Client.connect(socket=sys.argv[1], namespace="pf")
hs = [c.lookup(f"p{i}") for i in range(24)]
for step in range(3):
    for h in hs:
        with c.checkout(h, "r") as v:
            pass
    c.step()
for h in hs[:5]:
    with c.checkout(h, "r"):
        pass
print("mid", flush=True)
sys.stdin.read()
"""


def test_client_killed_mid_prefetch_leaves_nothing_pinned(daemon_factory):
    d = daemon_factory("--host-bytes", "8MiB", "--policy", "trace", "--prefetch-budget-bytes", "4MiB")
    with d.client("pf") as c:
        for i in range(24):
            c.put(torch.full((OBJ // 4,), float(i)), key=f"p{i}", tier="nvme")
    p = subprocess.Popen([sys.executable, "-c", CLIENT, d.socket], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "mid"
    p.send_signal(signal.SIGKILL)
    p.wait()
    with d.client("pf") as c:
        def settled():  # (a dead connection's clean-up runs on a control thread, after it is gone from `clients`)
            st = c.stat()
            pf = st["prefetch"]
            return st if st["clients"] == 1 and pf["queued"] == 0 and pf["protected_bytes"] == 0 and \
                st["leases"] == 0 else None
        st = poll_until(settled, "the killed client's prefetches, protections and leases are gone")
        pf = st["prefetch"]
        assert all(t["client"] != "?" for t in pf["traces"]) and len(pf["traces"]) == 0
        # nothing is held: one object the size of the whole usable tier fits (a put with
        # tier="host" finding no room is CapacityExceeded; once in, the demoter may move it
        # down at once, the tier being past its high watermark)
        big = c.put(torch.empty(7 << 20, dtype=torch.uint8), tier="host")
        assert c.info(big)["nbytes"] == 7 << 20


def test_two_step_cycles_are_learned(make_store):
    """Double-buffered state alternates between two sets of objects every step."""
    s, hs = _cyclic_store(make_store, "trace", True, n_objs=32)
    a, b = list(enumerate(hs[:16])), list(enumerate(hs[16:], start=16))
    for _ in range(3):
        _run_steps(s, a, 1)
        _run_steps(s, b, 1)
    rates = _run_steps(s, a, 1) + _run_steps(s, b, 1)
    assert min(rates) >= 0.95, rates
    assert s.stat()["prefetch"]["traces"][0]["state"] == "learned"


def test_candidate_walk_follows_the_eviction_order():
    """The lazy candidate walk (cheap per eviction) yields every resident object once,
    in the order of the policy's keys computed object by object — with one and with
    several traces, repeats, untraced and protected objects, and after inserts,
    removals and cursor moves (within a step and past its end) that the walk's own
    bookkeeping must follow."""
    import random

    from tierstore.policy import LRUPolicy, TracePolicy
    from tierstore.trace import TraceBook

    rng = random.Random(7)
    classes, parts = set(), set()
    for case in range(60):
        book = TraceBook()
        n_traces = 1 + case % 3
        for c in range(n_traces):
            seq = [rng.randrange(150) for _ in range(rng.randrange(5, 200))]
            t = book.get(f"c{c}", "")
            for _step in range(2):
                for oid in seq:
                    t.record(oid)
                t.step()
            assert t.state == "learned"
            for oid in seq[:rng.randrange(len(seq))]:
                t.record(oid)  # move the cursor somewhere mid-step
        protected = {o: ("c", 1) for o in rng.sample(range(170), 8)}
        def reach(t, budget=40):  # the prefetcher's rule, for objects of 1 + oid % 5 bytes
            total = 0
            for i in range(min(64, len(t.learned))):
                total += 1 + t.learned[(t.cursor + 1 + i) % len(t.learned)] % 5
                if total > budget:
                    return max(i, 1)
            return min(64, len(t.learned))
        pol = TracePolicy(book, protected, reach if case % 2 == 0 else None)
        resident = rng.sample(range(170), 90)  # some traced, some never used by a trace
        for oid in resident:
            pol.insert(oid)
        list(pol.candidates())  # builds the bookkeeping; the edits below must keep it right
        for oid in rng.sample(resident, 20):
            pol.remove(oid)
        for oid in rng.sample(range(170), 20):
            pol.insert(oid)
            pol.touch(rng.choice(resident))
        if case % 3:  # the cursors move on (sometimes past the end of the step)
            for t in book.learned_traces():
                moves = len(t.learned) + 1 if case % 5 == 0 else rng.randrange(1, len(t.learned) * 3 // 2 + 1)
                for j in range(moves):
                    t.record(t.learned[(t.cursor + 1) % len(t.learned)])
                    if j % 7 == 0 and case % 5:  # (not at all: a whole step passes unseen)
                        list(pol.candidates())  # lists split while the cursor moves
                        pol.remove(oid := rng.choice(list(pol._order)))
                        pol.insert(oid)
        walked = list(pol.candidates())
        assert sorted(walked) == sorted(pol._order)
        keys = pol.keys()
        free = [o for o in walked if o not in protected]
        assert walked == free + [o for o in walked if o in protected]
        assert [keys[o] for o in free] == sorted(keys[o] for o in free)
        classes |= {k[0] for k in keys.values()}
        parts |= {k[1] for k in keys.values() if k[0] == 1}
    assert classes == {0, 1, 2}  # untraced, beyond every reach, within one: all exercised
    assert parts == {0, 1, 2}  # beyond every reach: used in this step, ahead, held
    assert list(LRUPolicy().candidates()) == []


def _wait_queued(engine, n: int) -> None:
    """Until exactly ``n`` requests wait in the engine's queue (its one worker is held)."""
    poll_until(lambda: engine.queued() == n, f"{n} requests queued on the engine")


def test_a_late_hit_is_counted_with_its_wait(make_store):
    """An access that finds its object's prefetch still in flight waits for it (no
    second read) and counts as late, with the time it waited."""
    import threading
    import time

    s = make_store(host_bytes="8MiB", io_threads=1, io_chunk_bytes="1MiB")
    t = torch.randn(1 << 18)
    h = s.put(t, tier="nvme")
    block = threading.Event()
    try:
        s.engine.submit(block.wait, priority=1)  # holds the only worker
        _wait_queued(s.engine, 0)
        s.engine.submit(lambda: None)  # a demand request waiting: the prefetch read queues behind it
        s.prefetch([h], wait=False)
        _wait_queued(s.engine, 2)  # the prefetch read (one chunk) is queued
        assert s.info(h)["residency"] == ["nvme"]  # in flight, not there yet
        got, parked = {}, threading.Event()
        reader = threading.Thread(target=lambda: got.setdefault("t", s.get(h)))
        cv_wait = s.index.cv.wait

        def watched_wait(timeout=None):  # the reader parks on the index's lock: it waits for the read
            if threading.current_thread() is reader:
                parked.set()
            return cv_wait(timeout)

        s.index.cv.wait = watched_wait
        reader.start()
        assert parked.wait(10)
        time.sleep(0.3)  # not a synchronisation: the reader's wait, which must be counted
    finally:
        block.set()  # never leave the worker blocked (a failure would hang the teardown)
    reader.join(timeout=30)
    assert torch.equal(got["t"], t)
    p = s.stat()
    assert (p["prefetch"]["late"], p["prefetch"]["misses"]) == (1, 0)
    assert 0.25 <= p["prefetch"]["late_wait_s"] <= p["prefetch"]["stall_s"]
    assert p["tiers"]["nvme"]["bytes_read"] == t.numel() * 4  # read once, by the prefetch


def test_demand_io_overtakes_queued_prefetch_io(make_store):
    """On the I/O engine, demand requests (priority 0) queued after prefetch requests
    (priority 1) run first: in the pool itself, and for a store's reads."""
    import threading
    import time

    from tierstore.engine.posix import PriorityPool

    pool = PriorityPool(1, "test-io")
    gate = threading.Event()
    order = []
    pool.submit(gate.wait)  # occupies the only worker
    for i in range(5):
        pool.submit(order.append, f"prefetch{i}", priority=1)
    for i in range(3):
        pool.submit(order.append, f"demand{i}", priority=0)
    gate.set()
    pool.shutdown()
    assert order == ["demand0", "demand1", "demand2"] + [f"prefetch{i}" for i in range(5)]

    s = make_store(host_bytes="8MiB", io_threads=1, io_chunk_bytes="1MiB")
    big = torch.randn(1 << 20)  # 4 MiB: four chunks
    hb = s.put(big, tier="nvme")
    others = [s.put(torch.randn(1 << 18), tier="nvme") for _ in range(6)]  # 1 MiB: one chunk each
    ran = []
    read_chunk = s.nvme._read_chunk

    def logged(e, off, n, dst, *rest):  # observe the order the engine serves chunks in
        ran.append(dst.nbytes)
        return read_chunk(e, off, n, dst, *rest)
    s.nvme._read_chunk = logged
    block = threading.Event()
    try:
        s.engine.submit(block.wait, priority=1)  # hold the only worker while the backlog forms
        _wait_queued(s.engine, 0)
        # with a demand request waiting, even one-chunk prefetch reads queue (an idle engine
        # would see them issued at once from the prefetch workers)
        s.engine.submit(lambda: None)
        s.prefetch(others)
        _wait_queued(s.engine, 1 + len(others))  # the prefetch reads are queued now
        got = {}
        reader = threading.Thread(target=lambda: got.setdefault("t", s.get(hb)))
        reader.start()
        _wait_queued(s.engine, 1 + len(others) + 4)  # and the demand read's four chunks behind them
    finally:
        block.set()
    reader.join(timeout=30)
    assert torch.equal(got["t"], big)
    assert s.wait_prefetch(10)
    assert ran[:4] == [4 << 20] * 4 and sorted(ran[4:]) == [1 << 20] * 6, ran


def test_batched_access_keeps_the_window_full(make_store):
    """A loop that checks a layer out in one batch accesses in bursts; between bursts,
    each finished prefetch queues the next one (not only the next access), so the whole
    next batch is resident in time although only 2 fetches may be in flight."""
    s = make_store(host_bytes="8MiB", policy="trace", prefetch=True, prefetch_budget_bytes="4MiB",
                   prefetch_max_inflight=2, high_watermark=1.0, low_watermark=0.9)
    hs = [s.put(torch.full((OBJ // 4,), float(i)), key=f"p{i}", tier="nvme") for i in range(32)]
    batches = [hs[i:i + 8] for i in range(0, 32, 8)]  # 4 MiB each: the budget covers the next one
    rates = []
    for _ in range(6):
        before = s.stat()["prefetch"]
        for b, batch in enumerate(batches):
            with s.checkout_many(batch, "r") as ts:
                assert [t[0].item() for t in ts] == [float(8 * b + i) for i in range(8)]
            assert s.wait_prefetch(timeout_s=30)  # compute at least as long as the fetches
        s.step()
        after = s.stat()["prefetch"]
        rates.append((after["hits"] - before["hits"]) / sum(after[k] - before[k] for k in ("hits", "late", "misses")))
    assert min(rates[3:]) >= 0.95, rates
