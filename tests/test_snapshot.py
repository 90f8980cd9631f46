"""Snapshots: a namespace to a Zarr v3 store and back, readable with plain zarr."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

from tierstore import ChecksumMismatch, InvalidArgument, KeyExists


def _fill(s):
    data = {}
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool,
               torch.complex64, torch.float8_e4m3fn):
        for shape in ((), (0,), (5, 3), (300, 1024)):  # small ones packed, the last ones (>= 1 MiB for most) arrays
            t = torch.randn(shape, generator=g)
            t = (t > 0) if dt == torch.bool else t.to(dt)
            key = f"w/{str(dt).split('.')[1]}/{'x'.join(map(str, shape)) or 'scalar'}@v#0"
            s.put(t, key=key, durable=dt == torch.float32)
            data[key] = t
    a = np.arange(3 * 1024 * 100, dtype=np.float64).reshape(3, -1)
    s.put(a, key="numpy/big")
    data["numpy/big"] = a
    return data


def _check(s, data):
    assert sorted(s.keys()) == sorted(data)
    for k, t in data.items():
        got = s.get(s.lookup(k))
        if isinstance(t, np.ndarray):
            assert isinstance(got, np.ndarray) and np.array_equal(got, t)
        else:
            assert got.dtype == t.dtype and got.shape == t.shape
            # compare bytes: float8 has no equality kernel, and NaN != NaN would hide nothing here
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("suffix", [".zarr", ".zip"])
def test_round_trip_every_dtype(make_store, tmp_path, suffix):
    s = make_store(host_bytes="64MiB")
    data = _fill(s)
    dest = str(tmp_path / f"snap{suffix}")
    r = s.snapshot(dest)
    assert r["objects"] == len(data) and os.path.exists(dest)
    s2 = make_store(host_bytes="64MiB", nvme_dirs=[str(tmp_path / "other")])
    s2.restore(dest, namespace="copy")
    _check(_Ns(s2, "copy"), data)
    assert s2.info(s2.lookup("w/float32/5x3@v#0", namespace="copy"), namespace="copy")["durable"]
    with pytest.raises(KeyExists, match="--overwrite"):
        s2.restore(dest, namespace="copy")
    s2.restore(dest, namespace="copy", overwrite=True)
    _check(_Ns(s2, "copy"), data)


def test_empty_and_0d_objects_alone_round_trip(make_store, tmp_path):
    """A namespace of nothing but empty objects (no bytes to pack) and 0-d ones."""
    s = make_store()
    data = {"e/torch": torch.zeros(0, 3), "e/numpy": np.zeros((2, 0), np.int16)}
    for k, t in data.items():
        s.put(t, key=k)
    s.snapshot(str(tmp_path / "empty.zarr"))
    s.put(np.asarray(np.float32(1.5)), key="z/numpy")
    s.put(torch.tensor(7, dtype=torch.int32), key="z/torch")
    data.update({"z/numpy": np.asarray(np.float32(1.5)), "z/torch": torch.tensor(7, dtype=torch.int32)})
    s.snapshot(str(tmp_path / "mixed.zarr"))
    for name, want in (("empty.zarr", ["e/numpy", "e/torch"]), ("mixed.zarr", sorted(data))):
        s2 = make_store(nvme_dirs=[str(tmp_path / f"restore-{name}")])
        s2.restore(str(tmp_path / name))
        assert sorted(s2.keys()) == want
        for k in want:
            got, t = s2.get(s2.lookup(k)), data[k]
            assert type(got) is type(t) and got.shape == t.shape and got.dtype == t.dtype, k
            assert (np.array_equal(got, t) if isinstance(t, np.ndarray) else torch.equal(got, t)), k


class _Ns:
    def __init__(self, s, ns):
        self.s, self.ns = s, ns

    def keys(self):
        return self.s.keys(namespace=self.ns)

    def lookup(self, k):
        return self.s.lookup(k, namespace=self.ns)

    def get(self, h):
        return self.s.get(h, namespace=self.ns)


def test_readable_with_plain_zarr_and_small_objects_are_packed(make_store, tmp_path):
    s = make_store()
    big = torch.randn(512, 1024)
    s.put(big, key="layers/0/weight")
    for i in range(200):
        s.put(torch.full((10,), float(i)), key=f"small/{i}")
    dest = tmp_path / "snap.zarr"
    s.snapshot(str(dest))
    files = sum(len(f) for _, _, f in os.walk(dest))
    assert files < 30, files  # 200 small objects are not 200 files
    root = zarr.open_group(str(dest), mode="r")
    assert root.attrs["complete"] is True and root.attrs["namespace"] == "default"
    arr = root["layers/0/weight/~data"]
    assert arr.attrs["key"] == "layers/0/weight" and arr.attrs["dtype"] == "float32"
    assert np.array_equal(arr[...], big.numpy())
    e = next(e for e in root.attrs["objects"] if e["key"] == "small/7")
    raw = root[f"_packs/{e['pack']}"][e["offset"]:e["offset"] + e["nbytes"]]
    assert np.array_equal(raw.view(np.float32), np.full(10, 7.0, np.float32))


def test_corrupted_chunk_is_refused_and_named(make_store, tmp_path):
    s = make_store()
    s.put(torch.randn(512, 1024), key="victim")
    s.put(torch.ones(3), key="fine")
    dest = tmp_path / "snap.zarr"
    s.snapshot(str(dest))
    chunk = next(os.path.join(d, f) for d, _, fs in os.walk(dest / "victim" / "~data") for f in fs
                 if f != "zarr.json")
    with open(chunk, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatch, match="'victim'"):
        s.restore(str(dest), namespace="r")
    assert s.keys(namespace="r") == []  # nothing half-restored


SLOW_SNAPSHOT = r"""
import sys, torch
from tierstore import Config, Store
s = Store(Config(host_bytes="640MiB", nvme_dirs=[sys.argv[1]], nvme_bytes="2GiB"))
for i in range(250):
    s.put(torch.randn(512, 1024), key=f"t/{i}")
print("filled", flush=True)
s.snapshot(sys.argv[2])
"""


def test_interrupted_snapshot_is_refused(tmp_path):
    dest = tmp_path / "snap.zarr"
    p = subprocess.Popen([sys.executable, "-c", SLOW_SNAPSHOT, str(tmp_path / "nvme"), str(dest)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "filled"
    def started():
        return any(n.startswith("snap.zarr.partial") and os.path.isdir(tmp_path / n / "t")
                   for n in os.listdir(tmp_path))
    while not started():  # wait until objects are being written
        assert p.poll() is None and not dest.exists(), "the snapshot finished before it could be interrupted"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not dest.exists()  # nothing at DEST that looks complete
    partial = next(tmp_path / n for n in os.listdir(tmp_path) if n.startswith("snap.zarr.partial"))
    from tierstore import Config, Store

    with Store(Config(host_bytes="64MiB", nvme_dirs=[str(tmp_path / "n2")], nvme_bytes="1GiB")) as s:
        with pytest.raises(InvalidArgument, match="incomplete|not a readable"):
            s.restore(str(partial))
        with pytest.raises(InvalidArgument, match="no snapshot"):
            s.restore(str(dest))


def test_cli_snapshot_and_restore_through_the_daemon(daemon, tmp_path):
    with daemon.client("job") as c:
        c.put(torch.arange(10.0), key="a")
        c.put(torch.randn(300, 1024).to(torch.bfloat16), key="b/c")
    env = {**os.environ, "TIERSTORE_SOCKET": daemon.socket}
    dest = str(tmp_path / "job.zip")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "tierstore.client.cli", *args], capture_output=True, text=True,
                              env=env, timeout=120)
    r = cli("snapshot", "job", dest)
    assert r.returncode == 0 and "2 objects" in r.stdout, r.stderr
    r = cli("restore", dest, "--namespace", "job-copy")
    assert r.returncode == 0, r.stderr
    r = cli("restore", dest)  # back into "job": the keys exist
    assert r.returncode == 1 and "--overwrite" in r.stderr
    with daemon.client("job") as a, daemon.client("job-copy") as b:
        for k in ("a", "b/c"):
            assert torch.equal(a.get(a.lookup(k)), b.get(b.lookup(k)))


def test_a_snapshot_reads_a_key_replaced_after_the_listing_and_skips_what_was_freed(make_store, tmp_path):
    """Between the listing and the reads, one key is replaced (twice, the second time with
    another shape), another freed: the snapshot holds the key's value as read, leaves the
    freed one out and says so; restored, it is that state."""
    from tierstore.snapshot import snapshot
    from tierstore.store import _NamespaceView

    s = make_store(host_bytes="32MiB")
    s.put(torch.zeros(4), key="kept")
    s.put(torch.zeros(4), key="replaced")
    s.put(torch.zeros(300_000), key="gone")  # an array of its own (>= 1 MiB)

    class AfterListing(_NamespaceView):
        def ls(self, prefix=""):
            rows = super().ls(prefix)
            s.put(torch.ones(4), key="replaced", replace=True)
            s.put(torch.full((2, 3), 2.0), key="replaced", replace=True)
            s.free(s.lookup("gone"))
            return rows

    dest = str(tmp_path / "snap.zarr")
    r = snapshot(AfterListing(s, "default"), dest, namespace="default")
    assert r["objects"] == 2 and r["freed_meanwhile"] == 1
    s.restore(dest, namespace="copy")
    assert sorted(s.keys(namespace="copy")) == ["kept", "replaced"]
    assert torch.equal(s.get(s.lookup("replaced", namespace="copy"), namespace="copy"), torch.full((2, 3), 2.0))


def test_a_snapshot_while_a_writer_replaces_every_key_succeeds(make_store, tmp_path):
    """A writer thread replaces every key in a loop while snapshots run: each snapshot
    completes, and each object in it is one whole value its key held."""
    import threading

    s = make_store(host_bytes="64MiB")
    keys = [f"k{i}" for i in range(20)]
    for k in keys:
        s.put(torch.zeros(100_000), key=k)
    stop = threading.Event()

    def writer():
        v = 0
        while not stop.is_set():
            v += 1
            for k in keys:
                s.put(torch.full((100_000,), float(v)), key=k, replace=True)

    w = threading.Thread(target=writer)
    w.start()
    try:
        for i in range(3):
            dest = str(tmp_path / f"snap{i}.zarr")
            assert s.snapshot(dest)["objects"] == len(keys)
            root = zarr.open_group(dest, mode="r")
            for e in root.attrs["objects"]:
                arr = np.asarray(root[e["array"]][...]) if "array" in e else None
                if arr is not None:
                    assert (arr == arr.reshape(-1)[0]).all(), e["key"]
    finally:
        stop.set()
        w.join()


def _fill_up(directory, leave=0):
    """Fill ``directory``'s filesystem up to ``leave`` bytes free with one file; its path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb") as f:
        while os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize > leave:
            try:
                f.write(b"\0" * min(1 << 20, max(4096, os.statvfs(directory).f_bavail * 4096 - leave)))
                f.flush()
            except OSError:
                break
    return path


def test_a_full_disk_fails_a_snapshot_or_a_restore_cleanly(make_store, tmp_path, tmpfs):
    """A snapshot onto a full filesystem: one-line StorageError, nothing left behind. A
    restore that fills the pool's disk part-way: its error, and every object it had put
    taken back, so the same restore succeeds once there is room."""
    from tierstore import StorageError, TierstoreError

    s = make_store(host_bytes="64MiB")
    for i in range(12):
        s.put(torch.full((256 * 1024,), float(i)), key=f"t/{i}")  # 1 MiB each
    filler = _fill_up(tmpfs)
    with pytest.raises(StorageError, match="No space left") as e:
        s.snapshot(os.path.join(tmpfs, "snap.zarr"))
    assert "\n" not in str(e.value) and "(None)" not in str(e.value)
    assert sorted(os.listdir(tmpfs)) == ["filler"]
    os.unlink(filler)
    dest = str(tmp_path / "snap.zarr")
    s.snapshot(dest)

    nvme = os.path.join(tmpfs, "nvme")
    full = make_store(host_bytes="4MiB", nvme_dirs=[nvme], nvme_bytes="20MiB", nvme_grow_bytes="1MiB")
    filler = _fill_up(tmpfs, leave=3 << 20)
    with pytest.raises(TierstoreError):
        full.restore(dest, namespace="copy")
    assert full.keys(namespace="copy") == []
    os.unlink(filler)
    full.restore(dest, namespace="copy")
    for i in range(12):
        assert torch.equal(full.get(full.lookup(f"t/{i}", namespace="copy"), namespace="copy"),
                           torch.full((256 * 1024,), float(i)))


class _Interrupting:
    """A store's default namespace whose ``put`` is interrupted at the ``at``-th call
    (``KeyboardInterrupt``, as a user's Ctrl-C); every put's key is recorded."""

    def __init__(self, s, at=None):
        self.s, self.at, self.keys_put = s, at, []

    def __getattr__(self, name):
        return getattr(self.s, name)

    def put(self, tensor, key=None, **kw):
        if self.at is not None and len(self.keys_put) + 1 == self.at:
            raise KeyboardInterrupt
        self.keys_put.append(key)
        return self.s.put(tensor, key=key, **kw)


def test_an_interrupted_overwriting_restore_leaves_no_record_naming_half_restored_state(make_store, tmp_path):
    """A job's state restored --overwrite over its live state: bookkeeping keys (an
    optimizer's ``_progress``) go last, and the live one is freed before the first object
    is written over, so an interrupted restore leaves no record that names a mix of the
    two states (a resume then finds none, and says so)."""
    from tierstore.snapshot import restore

    s = make_store()
    keys = [f"opt/0.{i}/exp_avg@0" for i in range(6)] + ["params/_orig_mod.0.weight"]  # torch.compile's names
    for i, k in enumerate(keys):
        s.put(torch.full((1000,), float(i)), key=k)
    s.put(torch.tensor([5]), key="opt/_progress")
    dest = str(tmp_path / "step5.zarr")
    s.snapshot(dest)
    for i, k in enumerate(keys):  # the job goes on to step 10
        s.put(torch.full((1000,), 100.0 + i), key=k, replace=True)
    s.put(torch.tensor([10]), key="opt/_progress", replace=True)
    with pytest.raises(KeyboardInterrupt):
        restore(_Interrupting(s, at=1), dest, overwrite=True)
    assert s.lookup("opt/_progress") is None  # the live record goes first
    assert torch.equal(s.get(s.lookup(keys[-1])), torch.full((1000,), 106.0))  # a key with "_" is data: kept
    with pytest.raises(KeyboardInterrupt):
        restore(_Interrupting(s, at=4), dest, overwrite=True)
    assert s.lookup("opt/_progress") is None  # no record names the half-restored state
    whole = _Interrupting(s)
    restore(whole, dest, overwrite=True)
    assert whole.keys_put[-1] == "opt/_progress" and sorted(whole.keys_put[:-1]) == sorted(keys)
    assert int(s.get(s.lookup("opt/_progress"))) == 5
    for i, k in enumerate(keys):
        assert torch.equal(s.get(s.lookup(k)), torch.full((1000,), float(i)))
