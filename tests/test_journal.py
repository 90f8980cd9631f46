"""Journal damage anywhere in the file costs only the damaged records: no intact
acknowledged object is dropped, no acknowledged free is undone, namespace ownership
holds, the store always opens and says what it skipped."""

import os

import msgpack
import pytest
import torch

from tierstore import CapacityExceeded, Config, NoSpace, PermissionDenied, StorageError, Store
from tierstore.journal import JOURNAL_FILE, _encode, scan
from tierstore.replay import Replay


def _cfg(d, **kw):
    return Config(**{"host_bytes": "8MiB", "nvme_dirs": [str(d)], "nvme_bytes": "64MiB",
                     "nvme_grow_bytes": "4MiB", **kw})


def _records(d):
    data = (d / JOURNAL_FILE).read_bytes()
    return data, [(s, e, r) for s, e, r in scan(data) if r is not None]


def _damage(d, fn):
    data = bytearray((d / JOURNAL_FILE).read_bytes())
    fn(data)
    (d / JOURNAL_FILE).write_bytes(bytes(data))


def _find(recs, **match):
    hits = [(s, e, r) for s, e, r in recs if all(r.get(k) == v for k, v in match.items())]
    assert hits, match
    return hits[-1]


def test_flipped_free_record_with_its_extent_reused_keeps_the_later_object(tmp_path):
    d = tmp_path / "nvme"
    with Store(_cfg(d)) as s:
        a = s.put(torch.full((50_000,), 1.0), key="a", tier="nvme", durable=True)
        ext_a = s.index.objects[a.id].nvme
        s.free(a)
        b = s.put(torch.full((50_000,), 2.0), key="b", tier="nvme", durable=True)
        assert s.index.objects[b.id].nvme == ext_a  # b took a's space
        s.put(torch.full((10,), 3.0), key="c", tier="nvme", durable=True)
    data, recs = _records(d)
    start, end, _ = _find(recs, op="free", id=a.id)
    _damage(d, lambda buf: buf.__setitem__(end - 2, buf[end - 2] ^ 0x40))
    with Store(_cfg(d)) as s:
        assert sorted(s.keys()) == ["b", "c"]
        assert torch.equal(s.get(s.lookup("b")), torch.full((50_000,), 2.0))
        assert torch.equal(s.get(s.lookup("c")), torch.full((10,), 3.0))
        j = s.stat()["journal"]
        assert j["corrupt_records"] == 1 and j["torn_bytes"] == 0 and j["superseded"] == 0
        assert j["kept_aside"] and os.path.exists(j["kept_aside"])
    with Store(_cfg(d)) as s:  # the decision was made once; the rewritten journal is clean
        assert sorted(s.keys()) == ["b", "c"] and s.stat()["journal"]["corrupt_records"] == 0


def test_a_flipped_free_record_is_made_good_by_the_records_after_it(tmp_path):
    d = tmp_path / "nvme"
    with Store(_cfg(d)) as s:
        a = s.put(torch.ones(100), key="a", durable=True, tier="nvme")
        s.put(torch.ones(100) * 2, key="keep", durable=True, tier="nvme")
        s.free(a)
        s.put(torch.ones(100) * 3, key="later", durable=True, tier="nvme")
    _, recs = _records(d)
    _, end, _ = _find(recs, op="free", id=a.id)
    _damage(d, lambda buf: buf.__setitem__(end - 1, buf[end - 1] ^ 0xFF))
    with Store(_cfg(d)) as s:
        assert sorted(s.keys()) == ["keep", "later"]
        assert s.stat()["journal"]["corrupt_records"] == 1


def _workload(s, n=90):
    """Durable puts, replaces, write-backs and frees: what must be there, what must not."""
    want, freed = {}, []
    for i in range(n):
        k = f"k{i % 9}"
        t = torch.full((int(1000 + 997 * i),), float(i))
        h = s.put(t, key=k, tier="nvme", durable=True, replace=True)
        want[k] = (h, t)
        if i % 4 == 3:
            k2 = f"k{(i * 5) % 9}"
            if k2 in want:
                s.free(want[k2][0])
                freed.append(want.pop(k2)[0])
        if i % 5 == 2 and "k0" in want:
            with s.checkout(want["k0"][0], "rw") as v:  # a write-back: a second put record of k0
                v += 1
            want["k0"] = (want["k0"][0], want["k0"][1] + 1)
    return want, freed


@pytest.mark.parametrize("where", ["page", "length", "cut"])
def test_damage_in_the_middle_costs_only_the_damaged_records(tmp_path, where):
    import faults

    d = tmp_path / "nvme"
    with Store(_cfg(d)) as s:
        want, freed = _workload(s)
    data, recs = _records(d)
    assert len(data) > 3 * 4096
    if where == "page":  # a zeroed 4 KiB page in the middle
        zone = (4096, 8192)
        _damage(d, lambda buf: buf.__setitem__(slice(*zone), bytes(4096)))
    elif where == "length":  # a flipped length byte of a record in the middle
        s_, e_, _ = recs[len(recs) // 2]
        zone = (s_, e_)
        _damage(d, lambda buf: buf.__setitem__(s_ + 5, buf[s_ + 5] ^ 0x01))
    else:  # bytes cut out of the middle: everything after moves
        zone = (len(data) // 3, len(data) // 3 + 1500)
        _damage(d, lambda buf: buf.__delitem__(slice(*zone)))
    must, evidenced = faults.journal_evidence(data, [zone])
    with Store(_cfg(d)) as s:
        kept = {k: s.lookup(k) for k in s.keys()}
        for k, (h, t) in want.items():
            if h.id in must:
                assert kept.get(k) == h, f"{k}: its records are intact, but it was dropped"
                assert torch.equal(s.get(h), t)
        for h in freed:
            if h.id in evidenced:
                assert h not in kept.values(), f"{h}: an acknowledged free was undone"
        assert s.stat()["journal"]["kept_aside"]
        assert len(must) >= len(want) - 6  # the zone really was in the middle


def test_flipped_namespace_record_does_not_give_the_namespace_away(tmp_path):
    d = tmp_path / "nvme"
    with Store(_cfg(d)) as s:
        s.daemon.claim_namespace("team", 1000)
        s.put(torch.ones(10), key="w", durable=True, namespace="team")
        s.daemon.claim_namespace("empty", 1000)  # no object of its own: the records after it repeat it
        s.put(torch.ones(10), key="other", durable=True)
    _, recs = _records(d)
    for name in ("team", "empty"):
        s_, e_, _ = _find(recs, op="ns", name=name)
        _damage(d, lambda buf, e_=e_: buf.__setitem__(e_ - 3, buf[e_ - 3] ^ 0x10))
    with Store(_cfg(d)) as s:
        assert s.stat()["journal"]["corrupt_records"] == 2
        for name in ("team", "empty"):
            assert s.daemon.namespace_owner(name) == 1000
            with pytest.raises(PermissionDenied):
                s.daemon.check_namespace(name, 2000)
            with pytest.raises(PermissionDenied):
                s.daemon.claim_namespace(name, 2000)


def test_a_record_with_a_valid_crc_but_missing_or_wrong_fields_costs_that_record_alone(tmp_path):
    d = tmp_path / "nvme"
    with Store(_cfg(d)) as s:
        s.put(torch.ones(10), key="before", durable=True)
    bad = [{"op": "put", "id": 7}, {"id": 8},
           {"op": "put", "id": 9, "gen": 1, "ns": "default", "key": "x", "kind": "torch", "dtype": "float32",
            "shape": [4], "nbytes": 16, "ext": [[0, 12345, 0, 16]], "crc": [1]},  # an unaligned extent
           {"op": "free", "id": "1"}, {"op": "ns", "name": "default", "uid": -1},
           {"op": "open", "epoch": 1, "next_id": 2, "fr": ["x"]}]
    with open(d / JOURNAL_FILE, "ab") as f:  # framed as the journal frames them: the CRCs check out
        for r in bad:
            f.write(_encode(r))
    with Store(_cfg(d)) as s:
        j = s.stat()["journal"]
        assert j["malformed_records"] == 6
        s.put(torch.ones(10) * 2, key="after", durable=True)
        assert sorted(s.keys()) == ["after", "before"]
    with Store(_cfg(d)) as s:
        assert torch.equal(s.get(s.lookup("before")), torch.ones(10))


def test_the_daemon_starts_on_a_damaged_journal_and_says_what_it_skipped(daemon_factory):
    dm = daemon_factory()
    with dm.client() as c:
        c.put(torch.ones(100), key="a", durable=True)
        c.put(torch.ones(100) * 2, key="b", durable=True)
    dm.stop()
    path = os.path.join(dm.nvme, JOURNAL_FILE)
    data = bytearray(open(path, "rb").read())
    recs = [(s, e, r) for s, e, r in scan(bytes(data)) if r is not None]
    s_, e_, _ = _find(recs, op="put", key="a")
    data[e_ - 1] ^= 0xFF
    data += msgpack.packb({"not": "a record"})  # junk at the end, too
    with open(path, "wb") as f:
        f.write(data)
    with open(path, "ab") as f:
        f.write(_encode({"op": "put", "id": 99}))  # CRC-valid, fields missing
    dm.start()
    with dm.client() as c:
        assert c.keys() == ["b"]
        st = c.stat()["journal"]
        assert st["corrupt_records"] >= 1 and st["malformed_records"] == 1
    log = dm.log.read_text()
    assert "journal recovery:" in log and "journal record skipped" in log


def test_a_free_that_cannot_be_journaled_leaves_the_object_as_it_was(tmp_path):
    d = tmp_path / "nvme"
    with Store(_cfg(d)) as s:
        h = s.put(torch.arange(1000.0), key="x", durable=True)
        used = s.stat()["tiers"]["nvme"]["used_bytes"]
        # the journal's descriptor reopened read-only: every append fails
        ro = os.open(d / JOURNAL_FILE, os.O_RDONLY)
        saved = os.dup(s.journal._fd)
        os.dup2(ro, s.journal._fd)
        os.close(ro)
        with pytest.raises(StorageError, match="object is unchanged"):
            s.free(h)
        assert s.lookup("x") == h and torch.equal(s.get(h), torch.arange(1000.0))
        assert s.stat()["tiers"]["nvme"]["used_bytes"] == used
        os.dup2(saved, s.journal._fd)
        os.close(saved)
        s.free(h)  # and it can be freed once the journal is writable again
        assert s.lookup("x") is None
    with Store(_cfg(d)) as s:
        assert s.keys() == []


def test_a_free_on_a_full_filesystem_leaves_the_object_as_it_was(tmpfs):
    d = os.path.join(tmpfs, "nvme")
    with Store(Config(host_bytes="8MiB", nvme_dirs=[d], nvme_bytes="4MiB", nvme_grow_bytes="4MiB")) as s:
        h = s.put(torch.arange(1000.0), key="x", durable=True)
        _fill(os.path.join(tmpfs, "filler"))  # the filesystem full to the last page
        _fill(os.path.join(d, JOURNAL_FILE))  # and the journal's last page: the free record needs a new one
        with pytest.raises(NoSpace, match="object is unchanged"):
            s.free(h)
        assert torch.equal(s.get(s.lookup("x")), torch.arange(1000.0))


def test_a_free_whose_compaction_meets_a_full_filesystem_stands(tmpfs, caplog):
    """A durable free is journaled, then the journal's compaction (mostly garbage now)
    fails for want of room: the free stands — its key is gone, listings work, the other
    objects are intact — and a restart agrees."""
    import logging

    d = os.path.join(tmpfs, "nvme")
    cfg = Config(host_bytes="8MiB", nvme_dirs=[d], nvme_bytes="4MiB", nvme_grow_bytes="1MiB",
                 journal_compact_bytes="64MiB")
    with Store(cfg) as s:
        hs = [s.put(torch.full((16,), float(i)), key=f"k{i}", durable=True) for i in range(300)]
        for h in hs[:250]:
            s.free(h)
        _fill(os.path.join(tmpfs, "filler"))  # no room for the compacted copy; the free record fits the slack
        s.durability.compact_bytes = 16 << 10
        with caplog.at_level(logging.ERROR, logger="tierstore.durability"):
            s.free(hs[260])
        assert any("journal compaction failed" in r.getMessage() for r in caplog.records)
        assert s.lookup("k260") is None and len(s.keys()) == 49
        for i in range(250, 300):
            if i != 260:
                assert torch.equal(s.get(s.lookup(f"k{i}")), torch.full((16,), float(i)))
        s.free(hs[261])  # the next free does not try again at once, and stands too
        assert s.lookup("k261") is None
    os.unlink(os.path.join(tmpfs, "filler"))
    with Store(cfg) as s:
        assert sorted(s.keys()) == sorted(f"k{i}" for i in range(250, 300) if i not in (260, 261))
        assert torch.equal(s.get(s.lookup("k299")), torch.full((16,), 299.0))


def test_a_store_that_filled_its_filesystem_with_durable_churn_starts_again(tmpfs):
    """Durable puts and frees on a full filesystem go on in the journal's slack until one
    fails with ``NoSpace`` (a typed, one-line error); the process is then killed (no
    closing record): the next start still has room for its record and opens, with every
    object whose put returned."""
    from conftest import run_py

    d = os.path.join(tmpfs, "nvme")
    code = f"""
import os, sys, torch
from tierstore import Config, NoSpace, Store
s = Store(Config(host_bytes="8MiB", nvme_dirs=[{d!r}], nvme_bytes="4MiB", nvme_grow_bytes="4MiB"))
s.put(torch.zeros(4), key="anchor", durable=True)
fd = os.open({os.path.join(tmpfs, "filler")!r}, os.O_WRONLY | os.O_CREAT)
try:
    while True:
        os.write(fd, bytes(4096))
except OSError:
    pass
i = 0
try:
    while True:  # each replace journals a put and the old version's free
        s.put(torch.full((4,), float(i)), key="churn", durable=True, replace=True)
        i += 1
except NoSpace as e:
    st = os.stat(os.path.join({d!r}, "journal.log"))
    room = st.st_blocks * 512 - -(-st.st_size // 4096) * 4096  # allocated past its end, for the next start
    print(i, room, str(e).splitlines()[0], flush=True)
os._exit(9)
"""
    r = run_py(code, timeout=300)
    assert r.returncode == 9, r.stderr[-2000:]
    done, room, msg = r.stdout.split(" ", 2)
    assert int(done) > 100 and "journal" in msg, r.stdout
    assert int(room) >= 32 << 10, r.stdout  # the start's record needs no new block
    with Store(Config(host_bytes="8MiB", nvme_dirs=[d], nvme_bytes="4MiB", nvme_grow_bytes="4MiB")) as s:
        assert torch.equal(s.get(s.lookup("anchor")), torch.zeros(4))
        assert torch.equal(s.get(s.lookup("churn")), torch.full((4,), float(int(done) - 1)))


def _fill(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 512)
    except OSError:
        pass
    finally:
        os.close(fd)


def test_replay_resolves_conflicts_by_record_order():
    rp = Replay(ndrives=1, drive_bytes=1 << 20)

    def put(oid, off, key=None):
        rp.apply({"op": "put", "id": oid, "gen": 1, "ns": "n", "key": key, "kind": "numpy", "dtype": "uint8",
                  "shape": [10], "nbytes": 10, "ext": [[0, off, 0, 10]], "crc": [0]})

    put(1, 0, "a")
    put(2, 4096, "b")
    put(3, 0)  # reuses 1's page: 1 was freed though its free record is gone
    put(4, 8192, "b")  # a replace of 2 whose free was lost
    put(2, 12288, "b")  # a late write-back of the replaced 2: the newer object keeps the key
    assert sorted(rp.live) == [3, 4] and rp.superseded == 1 and rp.next_id == 5


@pytest.mark.parametrize("grow,order", [(0, ("nvme", "host")), (0, ("host", "nvme")), ("64KiB", ("nvme", "host"))])
def test_durable_objects_stay_readable_when_the_disk_and_both_tiers_are_full(tmpfs, grow, order):
    """NVMe data file reserved at start (or, ``grow`` set, grown as needed); the filesystem
    then filled to the last byte, the NVMe and host tiers filled with volatile objects
    (in either order; as far as the disk lets them): checking out (what a get through the
    daemon does) and getting each durable object still works."""
    d = os.path.join(tmpfs, "nvme")
    with Store(Config(host_bytes="8MiB", nvme_dirs=[d], nvme_bytes="12MiB", nvme_grow_bytes=grow,
                      io_chunk_bytes="1MiB")) as s:
        assert s.nvme.reserved == (grow == 0)
        assert (os.path.getsize(os.path.join(d, "data.bin")) == 12 << 20) == (grow == 0)
        durable = {s.put(torch.full((40_000,), float(i)), tier="nvme", durable=True): float(i) for i in range(4)}
        _fill(os.path.join(tmpfs, "filler"))  # the filesystem: full
        added = 1
        while added:  # (until neither takes more: the demoter may move host objects down meanwhile)
            added = 0
            for tier in order:
                while True:
                    try:
                        s.put(torch.ones(60_000), tier=tier)
                    except CapacityExceeded:
                        break
                    added += 1
        if grow == 0:  # reserved: the tiers filled up to their sizes (but for one read reserve)
            st = s.stat()["tiers"]
            assert st["nvme"]["free_bytes"] + st["host"]["free_bytes"] < 1 << 20, st
        for _ in range(2):
            for h, v in durable.items():
                with s.checkout(h, "r") as t:
                    assert torch.equal(t, torch.full((40_000,), v))
                assert torch.equal(s.get(h), torch.full((40_000,), v))


def test_a_store_opens_on_a_full_filesystem_whose_journal_ends_on_a_page_boundary(tmpfs):
    """The start appends a record of its own: where the journal's last page is full and the
    filesystem has no byte left, that append needs a new block. The journal keeps room
    allocated past its end, so the store still opens (with O_DIRECT where it had it: the
    probe reads the data file when it cannot write a file of its own), every durable
    object reads back, and a durable free and a durable put into the data file's space
    still go through."""
    from tierstore.journal import _frame, pack

    d = os.path.join(tmpfs, "nvme")

    def cfg():
        return Config(host_bytes="4MiB", nvme_dirs=[d], nvme_bytes="8MiB", io_chunk_bytes="1MiB")
    with Store(cfg()) as s:
        direct = s.stat()["tiers"]["nvme"]["direct_io"]
        vals = {f"k{i}": torch.full((250_000,), float(i)) for i in range(4)}
        for k, v in vals.items():
            s.put(v, key=k, durable=True, tier="nvme")
    j = os.path.join(d, JOURNAL_FILE)
    need = -os.path.getsize(j) % 4096 or 4096
    need += 4096 if need < 64 else 0
    pad = _frame(pack({"op": "close", "p": "x" * (need - 40)}))
    pad = _frame(pack({"op": "close", "p": "x" * (need - 40 + need - len(pad))}))  # a valid record, ignored
    with open(j, "ab") as f:
        f.write(pad)
    assert os.path.getsize(j) % 4096 == 0
    os.remove(os.path.join(d, "index.ckpt"))
    _fill(os.path.join(tmpfs, "filler"))
    assert os.statvfs(tmpfs).f_bavail == 0
    with Store(cfg()) as s:
        assert s.stat()["tiers"]["nvme"]["direct_io"] == direct  # (its probe file cannot be written: data.bin is read)
        for k, v in vals.items():
            assert torch.equal(s.get(s.lookup(k)), v), k
        s.free(s.lookup("k3"))  # its record: in the room kept past the journal's end
        vals["k4"] = torch.full((250_000,), 4.0)  # and a durable put into the data file's own space
        s.put(vals["k4"], key="k4", durable=True, tier="nvme")
        del vals["k3"]
    with Store(cfg()) as s:
        assert sorted(s.keys()) == sorted(vals)
        for k, v in vals.items():
            assert torch.equal(s.get(s.lookup(k)), v), k


def test_a_journal_that_cannot_be_kept_aside_is_not_rewritten(tmp_path, monkeypatch):
    """No copy as found, no final decision: the damaged journal is appended to as it is."""
    import shutil

    d = tmp_path / "nvme"
    with Store(_cfg(d)) as s:
        for i in range(4):
            s.put(torch.full((10,), float(i)), key=f"k{i}", durable=True)
    _, recs = _records(d)
    _, end, _ = _find(recs, op="put", key="k1")
    _damage(d, lambda buf: buf.__setitem__(end - 1, buf[end - 1] ^ 0xFF))
    damaged = (d / JOURNAL_FILE).read_bytes()

    def refuse(*a, **kw):
        raise OSError(1, "not here")
    monkeypatch.setattr(os, "link", refuse)
    monkeypatch.setattr(shutil, "copyfile", refuse)
    with Store(_cfg(d)) as s:
        assert sorted(s.keys()) == ["k0", "k2", "k3"] and s.stat()["journal"]["kept_aside"] is None
        s.put(torch.ones(3), key="after", durable=True)
    assert (d / JOURNAL_FILE).read_bytes().startswith(damaged)
    monkeypatch.undo()
    with Store(_cfg(d)) as s:
        assert sorted(s.keys()) == ["after", "k0", "k2", "k3"] and s.stat()["journal"]["kept_aside"]


def test_replayed_objects_share_specs_keep_packed_records_and_survive_compaction(tmp_path):
    d = tmp_path / "nvme"
    with Store(_cfg(d)) as s:
        for i in range(20):
            s.put(torch.full((4,), float(i)), key=f"k{i}", durable=True)
    clean = (d / JOURNAL_FILE).read_bytes()
    with Store(_cfg(d)) as s:
        assert (d / JOURNAL_FILE).read_bytes().startswith(clean)  # a clean journal is appended to, not rewritten
        metas = [s.index.objects[s.lookup(f"k{i}").id] for i in range(20)]
        # one spec for one shape, and each object's last record as its packed bytes, not a map
        assert all(m.spec is metas[0].spec for m in metas)
        assert all(msgpack.unpackb(m.record)["key"] == m.key for m in metas)
        def puts():  # (without the echoes of claims and frees: not the objects' own)
            return sorted(msgpack.packb({k: v for k, v in r.items() if k not in ("fr", "own")})
                          for _, _, r in _records(d)[1] if r["op"] == "put")
        before = puts()
        with s.journal.lock:
            s.durability.maybe_compact(force=True)
        assert puts() == before and len(before) == 20
    with Store(_cfg(d)) as s:
        assert s.replay_info["objects"] == 20 and not s.replay_info["kept_aside"]
        for i in range(20):
            assert torch.equal(s.get(s.lookup(f"k{i}")), torch.full((4,), float(i)))
