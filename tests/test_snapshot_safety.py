"""Snapshots safe in shared directories, for every valid key; restores that trust
nothing in the snapshot they read."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

from tierstore import ChecksumMismatch, InvalidArgument, TierstoreError

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


@pytest.mark.parametrize("suffix", [".zip", ".zarr"])
def test_a_link_planted_at_the_old_temporary_name_is_not_followed(make_store, tmp_path, suffix):
    s = make_store()
    s.put(torch.randn(300_000), key="big")
    s.put(torch.ones(5), key="small")
    shared = tmp_path / "shared"
    shared.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    dest = shared / f"ckpt{suffix}"
    planted = [f"{dest}.partial-{os.getpid() + k}" for k in range(-2, 3)]
    for p in planted:  # where the next snapshots used to write
        os.symlink(victim, p)
        os.symlink(victim, p + ".d")
    s.snapshot(str(dest))
    assert victim.read_bytes() == b"precious"
    assert not dest.is_symlink() and (dest.is_file() if suffix == ".zip" else dest.is_dir())
    assert all(os.path.islink(p) and os.readlink(p) == str(victim) for p in planted)
    left = set(os.listdir(shared)) - {os.path.basename(p) for p in planted} - {p.split("/")[-1] + ".d" for p in planted}
    assert left == {dest.name}  # no temporary left behind
    s2 = make_store(nvme_dirs=[str(tmp_path / "n2")])
    s2.restore(str(dest), namespace="copy")
    assert torch.equal(s2.get(s2.lookup("big", namespace="copy"), namespace="copy"), s.get(s.lookup("big")))


@needs_root
@pytest.mark.parametrize("suffix", [".zip", ".zarr"])
def test_a_temporary_directory_swapped_for_a_link_mid_snapshot_is_not_written_through(make_store, tmp_path, suffix):
    """In a shared directory without the sticky bit others may rename names: halfway
    through, the snapshot's temporary directory is renamed away and a link to a private
    directory planted at its name. Nothing is written into the private directory, nothing
    of it is read into a zip; the directory snapshot fails (its name no longer names
    what was written), the zip is whole."""
    import glob

    from tierstore.snapshot import snapshot
    from tierstore.store import _NamespaceView

    s = make_store()
    s.put(torch.randn(300_000), key="a/big")
    s.put(torch.ones(5), key="b/small")
    s.put(torch.randn(300_000), key="c/big")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "id_rsa").write_bytes(b"secret key")
    dest = shared / f"ckpt{suffix}"

    class Swapping(_NamespaceView):
        swapped = False

        def get(self, handle, *a, **kw):
            if not Swapping.swapped:
                [work] = glob.glob(f"{dest}.partial-*")
                os.rename(work, shared / "moved-away")
                os.symlink(private, work)
                Swapping.swapped = True
            return super().get(handle, *a, **kw)

    if suffix == ".zarr":
        with pytest.raises(TierstoreError, match="moved or replaced"):
            snapshot(Swapping(s, "default"), str(dest), namespace="default")
        assert not dest.exists()
    else:
        assert snapshot(Swapping(s, "default"), str(dest), namespace="default")["objects"] == 3
        import zipfile
        names = zipfile.ZipFile(dest).namelist()
        assert "id_rsa" not in names
        t = make_store(nvme_dirs=[str(tmp_path / "nvme2")])
        t.restore(str(dest))
        assert torch.equal(t.get(t.lookup("c/big")), s.get(s.lookup("c/big")))
    assert sorted(os.listdir(private)) == ["id_rsa"] and (private / "id_rsa").read_bytes() == b"secret key"


def test_a_link_planted_by_another_uid_is_not_followed(make_store, request):
    """The attacker is another user with write access to the shared directory."""
    import pwd

    import pathlib
    import tempfile

    s = make_store()
    s.put(torch.ones(10), key="x")
    base = pathlib.Path(tempfile.mkdtemp(prefix="tierstore-test-", dir="/tmp"))  # reachable by other uids
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    base.chmod(0o755)
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    victim = base / "victim"
    victim.write_bytes(b"precious")
    dest = shared / "ckpt.zip"
    nobody = pwd.getpwnam("nobody")
    pid = os.fork()
    if pid == 0:  # the attacker: plants links at every name the next snapshots could take
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            for pid in {os.getppid() + k for k in range(-50, 50)}:
                os.symlink(victim, f"{dest}.partial-{pid}")
                os.symlink(victim, f"{dest}.partial-{pid}.d")
            os._exit(0)
        except BaseException:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0
    s.snapshot(str(dest))
    assert victim.read_bytes() == b"precious"
    assert not dest.is_symlink() and dest.stat().st_uid == os.geteuid()
    assert [n for n in os.listdir(shared) if not os.path.islink(shared / n)] == ["ckpt.zip"]


HARD_KEYS = ["a/zarr.json", "zarr.json", "zarr.json/x", "c", "a/c/zarr.json", "a" * 300, "é" * 50,
             "é" * 50 + "/" + "b" * 250, "~" * 300, "x/" + "%" * 333]


@pytest.mark.parametrize("suffix", [".zarr", ".zip"])
def test_every_valid_key_can_be_snapshotted(make_store, tmp_path, suffix):
    s = make_store(host_bytes="64MiB")
    data = {}
    for i, k in enumerate(HARD_KEYS):
        t = torch.full((300_000,), float(i))  # >= 1 MiB: an array of its own at the key's path
        s.put(t, key=k)
        data[k] = t
    s.put(torch.ones(3), key="a" * 1000)  # small: packed
    data["a" * 1000] = torch.ones(3)
    dest = str(tmp_path / f"snap{suffix}")
    s.snapshot(dest)
    root = zarr.open_group(zarr.storage.ZipStore(dest, mode="r") if suffix == ".zip" else dest, mode="r")
    assert sorted(e["key"] for e in root.attrs["objects"]) == sorted(data)  # the true keys
    s2 = make_store(host_bytes="64MiB", nvme_dirs=[str(tmp_path / "n2")])
    s2.restore(dest, namespace="copy")
    for k, t in data.items():
        assert torch.equal(s2.get(s2.lookup(k, namespace="copy"), namespace="copy"), t), k


def test_a_snapshot_error_is_typed_and_leaves_nothing(make_store, tmp_path):
    s = make_store()
    s.put(torch.ones(10), key="x")
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "sub").write_text("a file, not a directory")
    with pytest.raises(TierstoreError, match="snapshot"):
        s.snapshot(str(ro / "sub" / "snap.zarr"))


# ---------------------------------------------------------------- crafted snapshots
def _snap(make_store, tmp_path, n_small=2, big=True):
    s = make_store()
    for i in range(n_small):
        s.put(torch.full((10,), float(i)), key=f"s{i}")
    if big:
        s.put(torch.randn(300_000), key="big")
    dest = tmp_path / "snap.zarr"
    s.snapshot(str(dest))
    return s, dest


def _edit(dest, fn):
    meta = json.loads((dest / "zarr.json").read_text())
    fn(meta["attributes"])
    (dest / "zarr.json").write_text(json.dumps(meta))


def _entry(attrs, key):
    return next(e for e in attrs["objects"] if e["key"] == key)


@pytest.mark.parametrize("path", ["../../outside/arr", "/etc/arr", "a/../../x", "big/./~data", ""])
def test_array_paths_outside_the_snapshot_are_refused(make_store, tmp_path, path):
    s, dest = _snap(make_store, tmp_path)
    out = tmp_path / "outside" / "arr"
    shutil.copytree(dest / "big" / "~data", out)  # a valid array an attacker placed outside
    _edit(dest, lambda a: _entry(a, "big").update(array=path))
    with pytest.raises(InvalidArgument, match="inside the snapshot|outside the snapshot"):
        s.restore(str(dest), namespace="r")
    assert s.keys(namespace="r") == []


def test_a_symlink_inside_the_snapshot_leading_outside_is_refused(make_store, tmp_path):
    s, dest = _snap(make_store, tmp_path)
    shutil.copytree(dest / "big" / "~data", tmp_path / "outside")
    shutil.rmtree(dest / "big" / "~data")
    os.symlink(tmp_path / "outside", dest / "big" / "~data")
    with pytest.raises(InvalidArgument, match="outside the snapshot"):
        s.restore(str(dest), namespace="r")
    assert s.keys(namespace="r") == []


@pytest.mark.parametrize("change", [{"nbytes": 0}, {"nbytes": 8}, {"shape": [100, 100]}, {"dtype": "object"},
                                    {"kind": "pickle"}, {"key": None}, {"key": 5}, {"crc32c": "x"},
                                    {"shape": [-1]}, {"pack": "0"}, {"dtype": "float8_bogus"}])
def test_entries_that_disagree_with_themselves_are_refused(make_store, tmp_path, change):
    s, dest = _snap(make_store, tmp_path, big=False)
    _edit(dest, lambda a: _entry(a, "s1").update(change))
    with pytest.raises(InvalidArgument, match="not a valid snapshot: entry 1"):
        s.restore(str(dest), namespace="r")
    assert s.keys(namespace="r") == []


def test_zero_bytes_with_a_shape_does_not_restore_memory(make_store, tmp_path):
    s, dest = _snap(make_store, tmp_path, big=False)

    def empty(a):
        e = _entry(a, "s0")
        e.update(shape=[25_000], nbytes=0, crc32c=0)
        e.pop("pack")
        e.pop("offset")
    _edit(dest, empty)
    with pytest.raises(InvalidArgument, match="disagrees with shape"):
        s.restore(str(dest), namespace="r")


def test_a_bad_entry_after_good_ones_restores_nothing(make_store, tmp_path):
    s, dest = _snap(make_store, tmp_path, n_small=5)
    _edit(dest, lambda a: a["objects"].append({"key": "late", "kind": "torch", "dtype": "float32", "shape": [4],
                                               "nbytes": 16, "crc32c": 0, "array": "../x"}))
    with pytest.raises(InvalidArgument, match="entry 6"):
        s.restore(str(dest), namespace="r")
    assert s.keys(namespace="r") == []


def test_a_missing_or_truncated_chunk_file_is_a_clear_error(make_store, tmp_path):
    s, dest = _snap(make_store, tmp_path)
    chunk = dest / "big" / "~data" / "c" / "0"
    data = chunk.read_bytes()
    chunk.write_bytes(data[:100])
    with pytest.raises(ChecksumMismatch, match="truncated"):
        s.restore(str(dest), namespace="r")
    chunk.unlink()
    with pytest.raises(InvalidArgument, match="'big' cannot be read.*FileNotFoundError"):
        s.restore(str(dest), namespace="r")
    assert s.keys(namespace="r") == []


def test_an_array_larger_than_its_entry_is_refused_before_allocating(make_store, tmp_path):
    s, dest = _snap(make_store, tmp_path)
    meta_path = dest / "big" / "~data" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"] = [1 << 40]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(InvalidArgument, match="holds .* bytes"):
        s.restore(str(dest), namespace="r")


def test_the_snapshot_namespace_does_not_redirect_a_restore(make_store, tmp_path):
    from tierstore.snapshot import snapshot_namespace

    s, dest = _snap(make_store, tmp_path, big=False)
    _edit(dest, lambda a: a.update(namespace="victim"))
    s.restore(str(dest), namespace="mine")  # the namespace given is the target
    assert s.keys(namespace="victim") == [] and len(s.keys(namespace="mine")) == 2
    for bad in ("../etc", "", 5, None):
        _edit(dest, lambda a: a.update(namespace=bad))
        with pytest.raises(InvalidArgument, match="pass --namespace"):
            snapshot_namespace(str(dest))


@needs_root
def test_a_restore_into_the_snapshots_namespace_needs_the_right_to_enter_it(daemon_factory, tmp_path):
    import grp
    import pwd

    group = grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name
    d = daemon_factory("--allowed-group", group, public=True)
    with d.client("root-job") as c:
        c.put(torch.ones(4), key="secret")
        c.snapshot(str(d.base / "snap.zarr"))
    for dirpath, dirs, files in os.walk(d.base / "snap.zarr"):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    code = r"""
import os, sys, pwd
from tierstore.client import cli
import tierstore.client.cli.support, tierstore.snapshot, tierstore.client.client, zarr, numpy
import tierstore.errors, tierstore.tensors, tierstore.arena
pw = pwd.getpwnam("nobody")
os.setgroups([]); os.setgid(pw.pw_gid); os.setuid(pw.pw_uid)
os.environ["TIERSTORE_SOCKET"] = sys.argv[1]
sys.exit(cli.main(["restore", sys.argv[2], "--overwrite"]))
"""
    r = subprocess.run([sys.executable, "-c", code, d.socket, str(d.base / "snap.zarr")], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "HOME": "/tmp"})
    assert r.returncode == 1 and "PermissionDenied" in r.stderr and "belongs to uid 0" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # one line
    with d.client("root-job") as c:
        assert c.keys() == ["secret"] and torch.equal(c.get(c.lookup("secret")), torch.ones(4))


@pytest.mark.parametrize("suffix", [".zip", ".zarr"])
def test_something_appearing_at_dest_meanwhile_is_left_alone(make_store, tmp_path, monkeypatch, suffix):
    import tierstore.snapshot as snap

    s = make_store()
    s.put(torch.ones(10), key="x")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    dest = tmp_path / f"snap{suffix}"
    real = snap._publish

    def racing(work, path, is_zip):  # a link to the victim appears at DEST just before the snapshot lands
        os.symlink(victim, path)
        return real(work, path, is_zip)
    monkeypatch.setattr(snap, "_publish", racing)
    with pytest.raises(TierstoreError, match="could not be put in place"):
        s.snapshot(str(dest))
    assert victim.read_bytes() == b"precious" and os.readlink(dest) == str(victim)
    assert sorted(os.listdir(tmp_path)) == sorted(["victim", dest.name, "nvme"])  # no temporary left


def _meta(d, apath, change):
    p = os.path.join(d, apath, "zarr.json")
    with open(p) as f:
        m = json.load(f)
    change(m)
    with open(p, "w") as f:
        json.dump(m, f)


@pytest.mark.parametrize("attack", ["chunks for nothing", "shape that wraps", "pack chunks for nothing",
                                    "fifo chunk", "fifo array metadata", "fifo index", "index is /dev/zero",
                                    "sparse chunk", "link out, read by zarr", "zip bomb", "fifo .zgroup",
                                    "gzip bomb", ".zip is a fifo", ".zip is /dev/zero"])
def test_a_hostile_snapshots_metadata_or_files_are_refused_at_once(make_store, tmp_path, attack):
    """Metadata that asks for 10^12 chunk files of nothing, a shape whose product wraps
    around in 64 bits, a FIFO where a file is read (which would hang), an index that is
    /dev/zero, a 2 GiB sparse chunk declared as 1.2 MB, a chunk link leading out read
    through zarr (an unusual codec), a 2 GiB zip entry deflated to 2 MiB, an array gzipped
    to 1 MiB from 1 GiB, a ``.zip`` source that is a FIFO or a link to /dev/zero: each
    refused in one line, at once, with nothing restored and no large allocation. A FIFO at a format 2 name (``.zgroup``) is never opened."""
    import zipfile

    s = make_store(host_bytes="64MiB")
    s.put(torch.arange(300_000, dtype=torch.float32), key="big")  # an array of its own
    s.put(torch.ones(5), key="small")  # in a pack
    d = str(tmp_path / "snap.zarr")
    s.snapshot(d)
    chunk = os.path.join(d, "big/~data/c/0")
    unusual = lambda m: m.update(codecs=[{"name": "bytes", "configuration": {"endian": "big"}}])  # noqa: E731
    src = d
    if attack == "chunks for nothing":
        _meta(d, "big/~data", lambda m: (m.update(shape=[10**12, 0]), m["chunk_grid"]["configuration"].update(
            chunk_shape=[1, 0])))
    elif attack == "shape that wraps":
        _meta(d, "big/~data", lambda m: (m.update(shape=[2**62, 4], data_type="uint8"),
                                         m["chunk_grid"]["configuration"].update(chunk_shape=[1, 4])))
    elif attack == "pack chunks for nothing":
        _meta(d, "_packs/0", lambda m: (m.update(shape=[10**12, 0]), m["chunk_grid"]["configuration"].update(
            chunk_shape=[1, 0])))
    elif attack == "fifo chunk":
        _meta(d, "big/~data", unusual)
        os.unlink(chunk)
        os.mkfifo(chunk)
    elif attack == "fifo array metadata":
        os.unlink(os.path.join(d, "big/~data/zarr.json"))
        os.mkfifo(os.path.join(d, "big/~data/zarr.json"))
    elif attack == "fifo index":
        os.unlink(os.path.join(d, "zarr.json"))
        os.mkfifo(os.path.join(d, "zarr.json"))
    elif attack == "index is /dev/zero":
        os.unlink(os.path.join(d, "zarr.json"))
        os.symlink("/dev/zero", os.path.join(d, "zarr.json"))
    elif attack == "fifo .zgroup":  # (a format 2 name zarr would read too, unchecked)
        os.mkfifo(os.path.join(d, ".zgroup"))
    elif attack == "gzip bomb":  # 1 MiB of file, far more once inflated
        import gzip
        _meta(d, "big/~data", lambda m: m.update(codecs=[{"name": "bytes", "configuration": {"endian": "little"}},
                                                         {"name": "gzip", "configuration": {"level": 9}}]))
        with open(chunk, "wb") as f:
            f.write(gzip.compress(b"\0" * (1 << 30), 9))
    elif attack == ".zip is a fifo":
        src = str(tmp_path / "snap.zip")
        os.mkfifo(src)
    elif attack == ".zip is /dev/zero":
        src = str(tmp_path / "snap.zip")
        os.symlink("/dev/zero", src)
    elif attack == "sparse chunk":
        _meta(d, "big/~data", unusual)
        with open(chunk, "r+b") as f:
            f.truncate(2 << 30)
    elif attack == "link out, read by zarr":
        _meta(d, "big/~data", unusual)
        outside = tmp_path / "outside.bin"
        outside.write_bytes(open(chunk, "rb").read())
        os.unlink(chunk)
        os.symlink(outside, chunk)
    else:
        src = str(tmp_path / "bomb.zip")
        with zipfile.ZipFile(src, "w", zipfile.ZIP_STORED) as z:
            for dp, _, fs in os.walk(d):
                for f in fs:
                    full = os.path.join(dp, f)
                    rel = os.path.relpath(full, d)
                    if rel == "big/~data/c/0":
                        info = zipfile.ZipInfo(rel)
                        info.compress_type = zipfile.ZIP_DEFLATED
                        with z.open(info, "w", force_zip64=True) as w:
                            for _ in range(32):
                                w.write(b"\0" * (64 << 20))
                    else:
                        z.write(full, rel)
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"  # a large allocation fails, not the machine
            "from tierstore import Store, TierstoreError\n"
            f"s = Store(host_bytes='16MiB', nvme_bytes='64MiB', nvme_dirs=[{str(tmp_path / 'nvme2')!r}])\n"
            "try:\n"
            f"    s.restore({src!r}, namespace='copy')\n"
            "except TierstoreError as e:\n"
            "    print(type(e).__name__, str(e).count(chr(10)), sorted(s.keys(namespace='copy')))\n"
            "    print(e)\n"
            "else:\n"
            "    print('restored', *sorted(s.keys(namespace='copy')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    if attack == "fifo .zgroup":  # never opened: the snapshot restores as it is
        assert r.stdout.split() == ["restored", "big", "small"], r.stdout
        return
    first, why = r.stdout.split("\n", 1)
    assert first.split() == ["InvalidArgument", "0", "[]"] and "MemoryError" not in why, r.stdout


def test_an_overwriting_restore_of_a_snapshot_changed_under_it_says_what_it_wrote(make_store, tmp_path):
    """A restore checks every object before writing any, then reads each again as it writes
    it: a snapshot that changes in between (a byte of its last object flipped after the
    first write) fails the restore. Without --overwrite what it wrote is taken back; with
    it, the keys already written over cannot be, and the error says how many were."""
    from tierstore import ChecksumMismatch
    from tierstore.snapshot import restore
    from tierstore.store import _NamespaceView

    s = make_store(host_bytes="128MiB")
    for i in range(10):
        s.put(torch.full((300_000,), float(i)), key=f"k{i}")
    dest = str(tmp_path / "snap.zarr")
    s.snapshot(dest)
    last = os.path.join(dest, "k9", "~data", "c", "0")

    class FlipAfterFirst(_NamespaceView):
        puts = 0

        def put(self, *a, **kw):
            h = super().put(*a, **kw)
            FlipAfterFirst.puts += 1
            if FlipAfterFirst.puts == 1:
                with open(last, "r+b") as f:
                    b = f.read(1)
                    f.seek(0)
                    f.write(bytes([b[0] ^ 0xFF]))
            return h

    for i in range(10):
        s.put(torch.full((300_000,), -1.0), key=f"k{i}", replace=True)
    with pytest.raises(ChecksumMismatch, match=r"changed while it was restored .*: 9 of 10 objects were already "
                                               r"written over their keys"):
        restore(FlipAfterFirst(s, "default"), dest, overwrite=True)
    assert [float(s.get(s.lookup(f"k{i}"))[0]) for i in range(10)] == [*map(float, range(9)), -1.0]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_restore_interrupted_between_a_put_and_its_answer(make_store, tmp_path, overwrite):
    """Ctrl-C lands after the target made an object but before its handle came back:
    without overwrite that object is taken back with the rest (the namespace is as it
    was); with it, the interrupt goes on as one, noting how many keys were written over."""
    from tierstore.snapshot import restore
    from tierstore.store import _NamespaceView

    s = make_store(host_bytes="64MiB")
    for i in range(6):
        s.put(torch.full((4,), float(i)), key=f"k{i}")
    d = str(tmp_path / "snap.zarr")
    s.snapshot(d)
    if not overwrite:
        for i in range(6):
            s.free(s.lookup(f"k{i}"))

    class Interrupted(_NamespaceView):
        puts = 0

        def put(self, *a, **kw):
            h = super().put(*a, **kw)
            Interrupted.puts += 1
            if Interrupted.puts == 3:  # made, then the interrupt before the caller has the handle
                raise KeyboardInterrupt
            return h

    with pytest.raises(KeyboardInterrupt) as info:
        restore(Interrupted(s, s.index.ns(None)), d, overwrite=overwrite)
    if overwrite:
        assert "interrupted with 2 of 6 objects already written over their keys" in "".join(info.value.__notes__)
    else:
        assert s.keys() == []


def test_an_index_that_lists_packs_out_of_order_is_refused(make_store, tmp_path):
    """An index whose packed objects go back to an earlier pack (each such entry would
    re-read a whole pack of up to 64 MiB: hours for a small index) is refused in one line,
    before any byte is read."""
    s = make_store()
    for i in range(3):
        s.put(torch.ones(4) * i, key=f"s{i}")
    d = tmp_path / "snap.zarr"
    s.snapshot(str(d))
    meta = json.loads((d / "zarr.json").read_text())
    objs = meta["attributes"]["objects"]
    assert [o.get("pack") for o in objs] == [0, 0, 0]
    objs[0]["pack"] = 1
    (d / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(InvalidArgument, match="packs in order"):
        s.restore(str(d), namespace="r")
    assert s.keys(namespace="r") == []
