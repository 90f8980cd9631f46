"""The index checkpoint: a restart loads the durable index from it and replays only the
journal records after it, ending in exactly the state a full replay of the journal
reaches; on any doubt it is not used and the whole journal is replayed, losing nothing."""

import os
import shutil
import signal
import subprocess
import sys

import msgpack
import pytest
import torch

from tierstore import Config, PermissionDenied, Store
from tierstore import checkpoint
from tierstore.checkpoint import CHECKPOINT_FILE
from tierstore.client.cli.statview import render
from tierstore.journal import JOURNAL_FILE, pack, scan


def _cfg(d, **kw):
    return Config(**{"host_bytes": "8MiB", "nvme_dirs": [str(d)], "nvme_bytes": "64MiB",
                     "nvme_grow_bytes": "4MiB", "io_chunk_bytes": "1MiB", **kw})


def _val(i, n=None):
    return torch.arange(n or 100 + i, dtype=torch.float32) * 3 + i


def _fill(s, n=40):
    """Durable objects of several kinds: keyed and not, two namespaces (one claimed by
    another uid), a multi-block one on NVMe, a replaced key and a freed object."""
    hs = {}
    for i in range(n):
        hs[f"k{i}"] = s.put(_val(i), key=f"k{i}", durable=True, tier="nvme" if i % 3 == 0 else None)
    hs["big"] = s.put(_val(7, 600_000), key="big", durable=True, tier="nvme")  # 2.3 MiB: 3 block CRCs
    hs["anon"] = s.put(_val(5), durable=True)
    s.daemon.claim_namespace("team", 4242)
    s.put(_val(9), key="t", durable=True, namespace="team")
    s.put(_val(11), key="k1", durable=True, replace=True)
    s.free(hs.pop("k2"))
    return hs


def _filled(tmp_path):
    """A directory whose store was filled (``_fill``) and closed cleanly: it has a checkpoint."""
    d = tmp_path / "nvme"
    with Store(_cfg(d)) as s:
        hs = _fill(s)
    assert (d / CHECKPOINT_FILE).exists()
    return d, hs


def _flip_record(d, key):
    """Flip the last byte of the journal's last record of ``key`` (its CRC no longer holds)."""
    jpath = d / JOURNAL_FILE
    data = bytearray(jpath.read_bytes())
    _, end, _ = [x for x in scan(bytes(data)) if x[2] is not None and x[2].get("key") == key][-1]
    data[end - 1] ^= 0xFF
    jpath.write_bytes(bytes(data))


def _state(s):
    """Everything a replay decides, per durable object and overall."""
    ix = s.index
    objs = {oid: (m.gen, m.namespace, m.key, m.spec, tuple(m.nvme or ()), tuple(m.crcs or ()), m.home, m.record)
            for oid, m in ix.objects.items() if m.durable}
    keys = {ns: ix.keys.scan(ns) for ns in ("default", "team")}
    used = s.stat()["tiers"]["nvme"]["used_bytes"]
    return objs, keys, dict(s.durability.owners), ix.epoch, ix.next_id, used


def _full_replay_state(d, tmp_path):
    """The state a start without the checkpoint reaches, from a copy of ``d`` as it is now."""
    ref = tmp_path / "reference"
    shutil.rmtree(ref, ignore_errors=True)
    shutil.copytree(d, ref)
    (ref / CHECKPOINT_FILE).unlink(missing_ok=True)
    with Store(_cfg(ref)) as s:
        assert s.replay_info["checkpoint"] == "none"
        return _state(s)


def _check_contents(s, hs, extra=(), gone=()):
    assert s.lookup("k2") is None
    assert torch.equal(s.get(s.lookup("k1")), _val(11))
    assert torch.equal(s.get(s.lookup("big")), _val(7, 600_000))
    assert torch.equal(s.get(hs["anon"]), _val(5))
    assert torch.equal(s.get(s.lookup("t", namespace="team"), namespace="team"), _val(9))
    skip = {"k1", "k2", *gone, *(k for k, _ in extra)}
    for i in range(40):
        if f"k{i}" not in skip:
            assert torch.equal(s.get(s.lookup(f"k{i}")), _val(i)), i
    for k in gone:
        assert s.lookup(k) is None, k
    for k, v in extra:
        assert torch.equal(s.get(s.lookup(k)), v), k
    assert s.daemon.namespace_owner("team") == 4242
    with pytest.raises(PermissionDenied):
        s.daemon.check_namespace("team", 1000)


def test_a_clean_close_writes_a_checkpoint_the_next_start_uses(tmp_path):
    d, hs = _filled(tmp_path)
    want = _full_replay_state(d, tmp_path)
    with Store(_cfg(d)) as s:
        j = s.stat()["journal"]
        assert j["checkpoint"] == "used" and j["records_replayed"] == 0
        assert _state(s) == want  # exactly what replaying every record gives
        _check_contents(s, hs)
        h = s.put(_val(99), key="later", durable=True)  # ids and the epoch go on from where they were
        assert h.id == want[4] and h.gen == want[3]


WRITER = r"""
import sys, torch
from tierstore import Config, Store
d = sys.argv[1]
s = Store(Config(host_bytes="8MiB", nvme_dirs=[d], nvme_bytes="64MiB", nvme_grow_bytes="4MiB",
                 io_chunk_bytes="1MiB"))
print(s.replay_info["checkpoint"], flush=True)
v = lambda i, n=None: torch.arange(n or 100 + i, dtype=torch.float32) * 3 + i
s.put(v(50), key="tail-new", durable=True)
s.put(v(51), key="k3", durable=True, replace=True)       # a replace of a checkpointed object
s.free(s.lookup("k4"))                                   # a free of one
s.put(v(52, 300_000), key="tail-big", durable=True, tier="nvme")  # in the space k4 gave back, maybe
s.daemon.claim_namespace("tail-team", 777)
s.put(v(53), key="x", durable=True, namespace="tail-team")
h = s.put(v(54), key="tail-gone", durable=True)
s.free(h)
print("done", flush=True)
sys.stdin.readline()
"""


def _kill_after_writer(d):
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(d)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        first, done = p.stdout.readline().strip(), p.stdout.readline().strip()
    finally:
        os.kill(p.pid, signal.SIGKILL)  # no clean close: no new checkpoint
        p.wait()
    assert done == "done", (first, done)
    return first


def test_changes_after_the_checkpoint_are_replayed_from_the_journal_tail_after_kill_9(tmp_path):
    d, hs = _filled(tmp_path)
    assert _kill_after_writer(d) == "used"
    want = _full_replay_state(d, tmp_path)
    with Store(_cfg(d)) as s:
        j = s.stat()["journal"]
        assert j["checkpoint"] == "used" and j["records_replayed"] >= 8
        assert j["corrupt_records"] == j["torn_bytes"] == j["superseded"] == 0
        assert _state(s) == want
        assert s.lookup("k4") is None and s.lookup("tail-gone") is None
        _check_contents(s, hs, [("tail-new", _val(50)), ("k3", _val(51)), ("tail-big", _val(52, 300_000))],
                        gone=["k4"])
        assert torch.equal(s.get(s.lookup("x", namespace="tail-team"), namespace="tail-team"), _val(53))
        with pytest.raises(PermissionDenied):
            s.daemon.check_namespace("tail-team", 1000)
        for k in s.keys():  # every object freed: no space is left held
            s.free(s.lookup(k))
        for ns in ("team", "tail-team"):
            for k in s.keys(namespace=ns):
                s.free(s.lookup(k, namespace=ns), namespace=ns)
        s.free(hs["anon"])
        assert s.stat()["tiers"]["nvme"]["used_bytes"] == 0
    with Store(_cfg(d)) as s:
        assert s.replay_info["checkpoint"] == "used" and len(s.index.objects) == 0


@pytest.mark.parametrize("where", ["magic", "version", "crc", "body-start", "body-middle", "last-byte"])
def test_a_flipped_byte_anywhere_in_the_checkpoint_means_a_full_replay(tmp_path, where):
    d, hs = _filled(tmp_path)
    p = d / CHECKPOINT_FILE
    data = bytearray(p.read_bytes())
    at = {"magic": 0, "version": 8, "crc": 12, "body-start": 24, "body-middle": len(data) // 2,
          "last-byte": len(data) - 1}[where]
    data[at] ^= 0x10
    p.write_bytes(bytes(data))
    with Store(_cfg(d)) as s:
        j = s.stat()["journal"]
        assert j["checkpoint"].startswith("refused") and j["records_replayed"] > 40
        _check_contents(s, hs)
    with Store(_cfg(d)) as s:  # the clean close wrote a good one again
        assert s.replay_info["checkpoint"] == "used"
        _check_contents(s, hs)


def test_a_cut_or_empty_checkpoint_means_a_full_replay(tmp_path):
    d, hs = _filled(tmp_path)
    p = d / CHECKPOINT_FILE
    for data in (p.read_bytes()[:-100], p.read_bytes()[:10], b""):
        p.write_bytes(data)
        with Store(_cfg(d)) as s:
            assert s.replay_info["checkpoint"].startswith("refused")
            _check_contents(s, hs)


def test_a_journal_rewritten_cut_or_damaged_after_the_checkpoint_makes_it_stale(tmp_path):
    d, hs = _filled(tmp_path)
    old = (d / CHECKPOINT_FILE).read_bytes()
    # rewritten: a compaction (which writes a checkpoint of its own), then the old one put back
    with Store(_cfg(d)) as s:
        s.put(_val(60), key="after", durable=True)
        s.durability.maybe_compact(force=True)
        assert s.replay_info["checkpoint"] == "used"
    (d / CHECKPOINT_FILE).write_bytes(old)
    with Store(_cfg(d)) as s:
        assert s.replay_info["checkpoint"].startswith("refused")
        _check_contents(s, hs, [("after", _val(60))])
    # cut: the journal shorter than what the checkpoint covered
    with Store(_cfg(d)):
        pass
    jpath = d / JOURNAL_FILE
    data = jpath.read_bytes()
    recs = [(b, e, r) for b, e, r in scan(data) if r is not None]
    b_, _, last = recs[-1]
    assert last["op"] == "open"
    jpath.write_bytes(data[:b_])  # the last (open) record gone: the checkpoint stands in for it
    with Store(_cfg(d)) as s:
        j = s.stat()["journal"]
        assert j["checkpoint"] == "used" and j["cut_bytes"] == len(data) - b_ and j["kept_aside"]
        _check_contents(s, hs, [("after", _val(60))])
    # damaged in the middle of the covered bytes: found, reported and kept aside as always
    _flip_record(d, "k20")
    with Store(_cfg(d)) as s:
        j = s.stat()["journal"]
        assert j["checkpoint"].startswith("refused") and j["corrupt_records"] == 1 and j["kept_aside"]
        _check_contents(s, hs, [("after", _val(60))], gone=["k20"])


@pytest.mark.parametrize("how", ["emptied", "halved", "removed", "cut inside its first record"])
def test_a_journal_cut_below_its_checkpoint_recovers_every_object_the_checkpoint_holds(tmp_path, how):
    """The journal emptied, cut in half or removed after a clean close: the checkpoint is
    the only record of its objects, so the start recovers them from it (an error saying
    so), rewrites the journal from them and keeps the checkpoint aside; the start after
    that needs neither, and what is freed then stays freed after a kill."""
    d, hs = _filled(tmp_path)
    jpath = d / JOURNAL_FILE
    data = jpath.read_bytes()
    if how == "removed":
        jpath.unlink()
    else:
        jpath.write_bytes({"halved": data[:len(data) // 2], "emptied": b""}.get(how, data[:5]))
    with Store(_cfg(d)) as s:
        j = s.stat()["journal"]
        assert j["checkpoint"] == "used" and j["cut_bytes"] > 0, j
        assert "cut" in render(s.stat())
        _check_contents(s, hs)
    assert len(list(d.glob(CHECKPOINT_FILE + ".damaged-*"))) == 1
    code = f"""
import os, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_checkpoint import _cfg
from tierstore import Store
s = Store(_cfg({str(d)!r}))
assert s.replay_info["checkpoint"] == "used" and not s.replay_info["cut_bytes"], s.replay_info
s.free(s.lookup("k5"))
os._exit(9)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr[-2000:]
    with Store(_cfg(d)) as s:
        assert not s.replay_info["cut_bytes"]
        _check_contents(s, hs, gone=["k5"])


@pytest.mark.parametrize("how", ["inside a record", "whole records near the end"])
def test_a_stretch_cut_out_of_a_journal_is_no_cut_the_checkpoint_stands_in_for(tmp_path, how):
    """Records after the checkpoint (a start, then durable puts, then a kill), and a
    stretch longer than them cut out of the middle of what the checkpoint covered: the
    journal is shorter than that, but not its beginning, so the checkpoint is not used
    and the full replay keeps every record left whole — the puts after it included."""
    d, hs = _filled(tmp_path)
    code = f"""
import os, sys, torch
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_checkpoint import _cfg
from tierstore import Store
s = Store(_cfg({str(d)!r}))
for i in range(3):
    s.put(torch.full((8,), float(i)), key=f"late{{i}}", durable=True)
os._exit(9)
"""
    covered = (d / JOURNAL_FILE).stat().st_size
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr[-2000:]
    data = (d / JOURNAL_FILE).read_bytes()
    late = len(data) - covered
    if how == "inside a record":
        recs = [(b, e, r) for b, e, r in scan(data) if r is not None and (r.get("key") or "").startswith("k")]
        lo = recs[len(recs) // 2][0] + 7  # from inside a record in the middle, more than the late records' bytes
        hi = lo + late + 500
    else:  # whole records, ending where the covered bytes do: no damage to see, in the last 4 KiB rung
        whole = [(b, e) for b, e, r in scan(data) if r is not None and e <= covered]
        hi = whole[-1][1]
        lo = next(b for b, _ in reversed(whole) if hi - b > late)
        assert lo >= (len(data) - (hi - lo)) // 4096 * 4096  # (past the last rung the ladder can check)
    (d / JOURNAL_FILE).write_bytes(data[:lo] + data[hi:])
    with Store(_cfg(d)) as s:
        j = s.stat()["journal"]
        assert j["checkpoint"].startswith("refused") and not j["cut_bytes"], j
        for i in range(3):
            assert torch.equal(s.get(s.lookup(f"late{i}")), torch.full((8,), float(i)))


@pytest.mark.parametrize("point", ["before", "after"])
def test_a_crash_as_a_cut_journal_is_rewritten_loses_nothing(tmp_path, point):
    """The start that recovers a cut journal from its checkpoint is killed just before, or
    just after, the rewritten journal takes the journal's name: the next start has every
    object either way (from the checkpoint again, or from the new journal, which the
    checkpoint no longer vouches for)."""
    d, hs = _filled(tmp_path)
    (d / JOURNAL_FILE).write_bytes(b"")
    code = f"""
import os, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_checkpoint import _cfg
from tierstore import Store
real = os.replace
def crash(src, dst):
    if dst.endswith("journal.log"):
        if {point!r} == "after":
            real(src, dst)
        os._exit(9)
    real(src, dst)
os.replace = crash
Store(_cfg({str(d)!r}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr[-2000:]
    with Store(_cfg(d)) as s:
        if point == "before":
            assert s.replay_info["checkpoint"] == "used" and s.replay_info["cut_bytes"] > 0, s.replay_info
        else:
            assert s.replay_info["checkpoint"].startswith("refused") and not s.replay_info["cut_bytes"]
        _check_contents(s, hs)


def test_a_large_sparse_file_at_the_checkpoint_name_is_refused_without_being_read(tmp_path):
    """1 GiB of holes where the checkpoint should be: refused by its header, with the
    whole journal replayed, and the start's memory never near the file's size."""
    d, hs = _filled(tmp_path)
    with open(d / CHECKPOINT_FILE, "r+b") as f:
        f.truncate(1 << 30)
    code = f"""
import os, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_checkpoint import _cfg
from tierstore import Store
with Store(_cfg({str(d)!r})) as s:
    # this process's own peak (VmHWM: ru_maxrss would count the parent it was forked from)
    hwm = [ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0]
    print(s.replay_info["checkpoint"], "|", hwm)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    why, peak_kib = r.stdout.strip().rsplit("|", 1)
    assert why.startswith("refused") and int(peak_kib) < (512 << 10), r.stdout
    with Store(_cfg(d)) as s:
        _check_contents(s, hs)


@pytest.mark.parametrize("where", ["a hole in the middle", "a hole at the end"])
def test_a_journal_with_a_gigabyte_of_holes_is_replayed_in_bounded_memory(tmp_path, where):
    """1 GiB of zeros (sparse) between two of the journal's records (no checkpoint: the
    whole journal is replayed, the records past the hole found again) or after its last
    (a torn tail past what the checkpoint covers): every object comes back, and the
    start's memory stays far below the journal's size — it is scanned through a mapping,
    a window at a time, never read whole."""
    d, hs = _filled(tmp_path)
    jpath = d / JOURNAL_FILE
    data = jpath.read_bytes()
    if where == "a hole in the middle":
        os.unlink(d / CHECKPOINT_FILE)
        cut = [end for _, end, r in scan(data) if r is not None][10]
        with open(jpath, "r+b") as f:
            f.truncate(cut)
            f.truncate(cut + (1 << 30))
            f.seek(cut + (1 << 30))
            f.write(data[cut:])
    else:
        with open(jpath, "r+b") as f:
            f.truncate(len(data) + (1 << 30))
    code = f"""
import os, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_checkpoint import _cfg, _check_contents
from tierstore import Store
with Store(_cfg({str(d)!r})) as s:
    hwm = [ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0]
    print(s.replay_info["corrupt_bytes"], s.replay_info["torn_bytes"], "|", hwm)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    damage, peak_kib = r.stdout.strip().rsplit("|", 1)
    corrupt, torn = map(int, damage.split())
    assert (corrupt, torn) == ((1 << 30, 0) if where == "a hole in the middle" else (0, 1 << 30)), r.stdout
    assert int(peak_kib) < (512 << 10), r.stdout
    with Store(_cfg(d)) as s:
        _check_contents(s, hs)


def test_a_checkpoint_from_another_directory_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with Store(_cfg(a)) as s:
        hs = _fill(s)
    with Store(_cfg(b)) as s:
        s.put(_val(1), key="only-in-b", durable=True)
    shutil.copyfile(a / CHECKPOINT_FILE, b / CHECKPOINT_FILE)
    with Store(_cfg(b)) as s:
        assert s.replay_info["checkpoint"].startswith("refused")
        assert s.keys() == ["only-in-b"]
    with Store(_cfg(a)) as s:
        assert s.replay_info["checkpoint"] == "used"
        _check_contents(s, hs)


def _rewrite_checkpoint(d, edit):
    """A checkpoint for ``d``'s journal as it is, whose object records ``edit`` changed:
    consistent and CRC-valid, but not what the journal says."""
    with Store(_cfg(d)) as s:
        with s.durability.lock:
            records = s.durability._live_records()
    ident = checkpoint.journal_identity(str(d / JOURNAL_FILE))
    recs = [r if not isinstance(r, bytes) else msgpack.unpackb(r) for r in records]
    puts = [r for r in recs if r.get("op") == "put"]
    edit(puts)
    checkpoint.write(str(d), ident, [pack(r) if r.get("op") == "put" else r for r in recs])


@pytest.mark.parametrize("bad,why", [("outside the tier", "outside the configured NVMe tier"),
                                     ("overlapping", "overlap"), ("unaligned", "outside the configured"),
                                     ("drive", "outside the configured"), ("crc count", "CRC count"),
                                     ("key twice", "held by two"), ("bad key", "key is invalid"),
                                     ("bad namespace", "namespace in the table")])
def test_a_consistent_checkpoint_with_impossible_objects_is_refused(tmp_path, bad, why):
    d, hs = _filled(tmp_path)

    def edit(puts):
        p, q = puts[3], puts[4]
        if bad == "outside the tier":
            p["ext"][0][1] = 64 << 20
        elif bad == "overlapping":
            p["ext"][0][1] = q["ext"][0][1]
        elif bad == "unaligned":
            p["ext"][0][1] += 512
        elif bad == "drive":
            p["ext"][0][0] = 1
        elif bad == "crc count":
            p["crc"].append(0)
        elif bad == "key twice":
            p["key"] = q["key"]
        elif bad == "bad key":
            p["key"] = "a\nb"
        elif bad == "bad namespace":
            p["ns"] = "../up"
    _rewrite_checkpoint(d, edit)
    with Store(_cfg(d)) as s:
        assert s.replay_info["checkpoint"].startswith("refused") and why in s.replay_info["checkpoint"]
        _check_contents(s, hs)


def test_damage_in_the_journal_tail_is_handled_as_without_a_checkpoint(tmp_path):
    d, hs = _filled(tmp_path)
    old = (d / CHECKPOINT_FILE).read_bytes()
    with Store(_cfg(d)) as s:
        for i in range(5):
            s.put(_val(70 + i), key=f"tail{i}", durable=True)
    (d / CHECKPOINT_FILE).write_bytes(old)  # still valid: the journal only grew since
    _flip_record(d, "tail2")
    with Store(_cfg(d)) as s:
        j = s.stat()["journal"]
        assert j["checkpoint"] == "used" and j["corrupt_records"] == 1 and j["kept_aside"]
        assert s.lookup("tail2") is None
        _check_contents(s, hs, [(f"tail{i}", _val(70 + i)) for i in (0, 1, 3, 4)])
    with Store(_cfg(d)) as s:  # the damage was not carried forward
        assert s.stat()["journal"]["corrupt_records"] == 0
        _check_contents(s, hs, [(f"tail{i}", _val(70 + i)) for i in (0, 1, 3, 4)])


def test_after_a_failed_journal_sync_no_checkpoint_vouches_for_what_memory_holds(tmp_path):
    d, hs = _filled(tmp_path)
    old = (d / CHECKPOINT_FILE).read_bytes()
    s = Store(_cfg(d))
    s.put(_val(80), key="in-memory-only", durable=True)
    s.journal._sync_failed = "an fdatasync failed (test)"
    data = (d / JOURNAL_FILE).read_bytes()  # what the failed sync left on disk: without that put's record
    s.close()
    assert (d / CHECKPOINT_FILE).read_bytes() == old
    (d / JOURNAL_FILE).write_bytes(data[:next(b for b, _, r in scan(data) if r and r.get("key") == "in-memory-only")])
    with Store(_cfg(d)) as s:
        assert s.replay_info["checkpoint"] == "used" and s.lookup("in-memory-only") is None
        _check_contents(s, hs)


def test_the_daemon_restarts_from_its_checkpoint_after_sigterm_and_after_sigkill(daemon_factory):
    dm = daemon_factory()
    with dm.client() as c:
        for i in range(30):
            c.put(_val(i), key=f"o{i}", durable=True)
    dm.stop()  # SIGTERM: a clean close writes the checkpoint
    dm.start()
    with dm.client() as c:
        st = c.stat()
        assert st["journal"]["checkpoint"] == "used" and st["journal"]["records_replayed"] == 0
        assert "started from the index checkpoint, then 0 records" in render(st)  # tierstore stat
        c.put(_val(100), key="after", durable=True)
        c.put(_val(101), key="o3", durable=True, replace=True)
        c.free(c.lookup("o4"))
    dm.kill()  # SIGKILL: the tail after the checkpoint is replayed
    dm.start()
    with dm.client() as c:
        j = c.stat()["journal"]
        assert j["checkpoint"] == "used" and j["records_replayed"] >= 4 and j["corrupt_records"] == 0
        assert c.lookup("o4") is None
        assert torch.equal(c.get(c.lookup("after")), _val(100))
        assert torch.equal(c.get(c.lookup("o3")), _val(101))
        for i in range(30):
            if i not in (3, 4):
                assert torch.equal(c.get(c.lookup(f"o{i}")), _val(i)), i
    log = dm.log.read_text()
    assert "index checkpoint used" in log and "from the index checkpoint and" in log  # and the start line


def test_tail_records_meet_checkpointed_objects_exactly_as_in_a_full_replay(tmp_path):
    """Every conflict rule across the checkpoint's edge: a tail put in a checkpointed
    object's space supersedes it (its free lost), a higher id takes its key, a late record
    of a replaced object is ignored, a write-back moves it, frees and echoed frees remove,
    and a disagreeing namespace claim is ignored."""
    from tierstore.replay import Replay
    from tierstore.journal import Journal, ReplayResult

    def put(oid, key, off, n=16, ns="job", gen=1, **kw):
        return {"op": "put", "id": oid, "gen": gen, "ns": ns, "key": key, "kind": "numpy", "dtype": "uint8",
                "shape": [n], "nbytes": n, "ext": [[0, off, 0, n]], "crc": [0], "home": None, **kw}
    prefix = [{"op": "open", "epoch": 3, "next_id": 1}, {"op": "ns", "name": "job", "uid": 10},
              *[put(i, f"k{i}", i * 4096, nsuid=10) for i in range(1, 9)], put(9, None, 9 * 4096)]
    tail = [put(20, "new", 1 * 4096),                      # in object 1's space: 1 is superseded
            put(21, "k2", 40 * 4096),                      # a higher id takes k2: 2 goes
            put(3, "k3", 41 * 4096, gen=2),                # a write-back of 3 to new space
            put(22, "mine", 3 * 4096),                     # ... into 3's old space: nothing superseded
            {"op": "free", "id": 4},
            put(23, "z", 42 * 4096, fr=[5]),               # a free known only from its echo
            {"op": "ns", "name": "job", "uid": 11},        # a later claim by another uid: ignored
            put(5, "k5", 5 * 4096),                        # a record of 5 after its (echoed) free
            put(9, None, 44 * 4096, gen=2),                # the keyless object written back
            put(7, "k8", 45 * 4096),                       # a key a higher id holds: on its way out
            {"op": "open", "epoch": 4, "next_id": 30}]
    d = tmp_path / "j"
    d.mkdir()
    j = Journal(str(d))
    j.rewrite(iter(prefix))
    ident = checkpoint.journal_identity(j.path)
    checkpoint.write(str(d), ident, [r if r["op"] != "put" else pack(r) for r in prefix])
    j.open_for_append()
    for r in tail:
        j.append(r, sync=False)
    j.close()

    def replayed(seed):
        rp, res = Replay(ndrives=1, drive_bytes=1 << 30), ReplayResult()
        start = 0
        if seed:
            ck = checkpoint.load(str(d), j.path, ndrives=1, drive_bytes=1 << 30)
            rp.seed(ck)
            start = ck.offset
        for r, payload in j.stream(res, start):
            rp.apply(r, payload)
        return ({oid: (m.gen, m.namespace, m.key, m.nvme, m.record) for oid, m in rp.live.items()},
                rp.owners, rp.epoch, rp.next_id, rp.superseded, rp.owner_conflicts, rp.malformed)
    full, seeded = replayed(False), replayed(True)
    assert seeded == full
    live = full[0]
    assert 1 not in live and 2 not in live and 4 not in live and 20 in live and 22 in live
    assert live[3][0] == 2 and live[9][0] == 2
    assert full[1] == {"job": 10} and full[4] == 1 and full[5] >= 1  # (the claim's echoes count too)


def test_every_flipped_byte_of_a_checkpoint_is_refused(tmp_path):
    d, _ = _filled(tmp_path)
    p, jpath = d / CHECKPOINT_FILE, str(d / JOURNAL_FILE)
    good = p.read_bytes()
    assert checkpoint.load(str(d), jpath, ndrives=1, drive_bytes=64 << 20) is not None
    for at in sorted({*range(0, 32), *range(0, len(good), max(1, len(good) // 300)), len(good) - 1}):
        bad = bytearray(good)
        bad[at] ^= 0x01
        p.write_bytes(bytes(bad))
        with pytest.raises(checkpoint.Refused):
            checkpoint.load(str(d), jpath, ndrives=1, drive_bytes=64 << 20)


def test_a_compaction_writes_the_checkpoint_of_the_journal_it_wrote(tmp_path):
    d, hs = _filled(tmp_path)
    with Store(_cfg(d)) as s:
        s.free(hs["k5"])
        s.durability.maybe_compact(force=True)
        ck = checkpoint.load(str(d), str(d / JOURNAL_FILE), ndrives=1, drive_bytes=64 << 20)
        assert ck is not None and ck.offset == (d / JOURNAL_FILE).stat().st_size
        assert hs["k5"].id not in ck.live and set(ck.live) == {oid for oid, m in s.index.objects.items()}
        s.put(_val(90), key="after-compaction", durable=True)
        s.journal.close()  # flushed, but no clean close: the compaction's checkpoint and a tail
        s.durability.close = lambda: None
    with Store(_cfg(d)) as s:
        j = s.stat()["journal"]
        assert j["checkpoint"] == "used" and j["records_replayed"] == 1
        _check_contents(s, hs, [("after-compaction", _val(90))], gone=["k5"])


def test_objects_published_out_of_id_order_still_give_a_usable_checkpoint(tmp_path):
    """Ids are given at reservation, objects published when their puts commit: concurrent
    clients commit out of id order. The checkpoint of such a store is used all the same."""
    from tierstore.tensors import TensorSpec

    d = tmp_path / "nvme"
    spec = TensorSpec("torch", "float32", (100,), 400)
    with Store(_cfg(d)) as s:
        owner = object()
        first, second = (s.daemon.reserve_put(spec, key=k, tier=None, durable=True, replace=False,
                                              namespace="default", owner=owner) for k in ("a", "b"))
        for res, v in ((first, 1.0), (second, 2.0)):
            s.arena.view(res.host_off, 400)[:] = torch.full((100,), v).numpy().view("uint8")
        hb = s.daemon.commit_put(second.rid, owner=owner)  # the later id is published first
        ha = s.daemon.commit_put(first.rid, owner=owner)
        assert ha.id < hb.id and list(s.index.objects)[-2:] == [hb.id, ha.id]
    with Store(_cfg(d)) as s:
        assert s.stat()["journal"]["checkpoint"] == "used"
        assert torch.equal(s.get(s.lookup("a")), torch.full((100,), 1.0))
        assert torch.equal(s.get(s.lookup("b")), torch.full((100,), 2.0))


def test_replaces_of_one_key_committed_out_of_id_order_restart_as_they_were_served(tmp_path):
    """Two puts of one key reserved A then B and committed B then A: A, the last published,
    holds the key; a full replay (after kill -9: no checkpoint), a restart from the
    checkpoint and one from a compacted journal all agree, and so do later write-backs."""
    import shutil

    from tierstore.checkpoint import CHECKPOINT_FILE
    from tierstore.tensors import to_bytes

    d = tmp_path / "nvme"
    s = Store(_cfg(d))

    def reserve(v):
        u8, spec = to_bytes(torch.full((8,), v))
        r = s.daemon.reserve_put(spec, key="k", tier=None, durable=True, replace=True, namespace="default",
                                 owner="w")
        s.arena.view(r.host_off, spec.nbytes)[:] = u8
        return r
    a, b = reserve(1.0), reserve(2.0)
    assert a.meta.id < b.meta.id
    s.daemon.commit_put(b.rid, owner="w")
    s.daemon.commit_put(a.rid, owner="w")  # committed last: it replaces b
    s.put(torch.ones(4), key="later", durable=True)  # (a later object keeps the ids going)
    assert torch.equal(s.get(s.lookup("k")), torch.full((8,), 1.0))
    crash = tmp_path / "crash"
    shutil.copytree(d, crash)  # what kill -9 leaves: the journal, no checkpoint of this
    (crash / CHECKPOINT_FILE).unlink(missing_ok=True)
    s.close()
    for where, how in ((crash, "none"), (d, "used")):
        with Store(_cfg(where)) as s2:
            assert s2.replay_info["checkpoint"] == how
            assert torch.equal(s2.get(s2.lookup("k")), torch.full((8,), 1.0)), where
            s2.durability.maybe_compact(force=True)
            h = s2.put(torch.ones(2), key="after", durable=True)
            assert h.id > max(a.meta.order, b.meta.id)  # (orders come from the id counter)
        with Store(_cfg(where)) as s3:
            assert torch.equal(s3.get(s3.lookup("k")), torch.full((8,), 1.0))
