"""The daemon's start: checks that can refuse it come first and take milliseconds, the
arena is populated while the socket already accepts, and one log line says what the
tiers are and where."""

import logging
import os
import re
import subprocess
import sys
import threading

import numpy as np
import torch
import pytest

from tierstore import Config, InvalidArgument, Store


def _daemon(tmp_path, *flags, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "tierstore.daemon", "--socket", str(tmp_path / "s" / "t.sock"),
                           *flags], capture_output=True, text=True, timeout=60, env=e)


def _one_error_line(r):
    lines = [ln for ln in r.stderr.splitlines() if " ERROR " in ln]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_an_unusable_nvme_dir_is_refused_before_the_arena_exists(tmp_path):
    r = _daemon(tmp_path, "--nvme-dir", "/proc/nonexistent", "--host-bytes", "64MiB")
    line = _one_error_line(r)
    assert r.returncode == 1 and "cannot create NVMe directory /proc/nonexistent" in line and "--nvme-dir" in line
    assert "host arena" not in r.stderr  # nothing was mapped before the refusal


def test_a_locked_nvme_dir_is_refused_before_the_arena_exists(daemon, tmp_path):
    r = _daemon(tmp_path, "--nvme-dir", daemon.nvme, "--host-bytes", "64MiB")
    line = _one_error_line(r)
    assert r.returncode == 1 and f"is in use by pid {daemon.proc.pid}" in line
    assert "host arena" not in r.stderr


def test_a_bad_variable_stops_the_daemon_with_one_line_naming_it(tmp_path):
    r = _daemon(tmp_path, "--nvme-dir", str(tmp_path / "n"), env={"TIERSTORE_PREFETCH_MAX_INFLIGHT": "abc"})
    line = _one_error_line(r)
    assert r.returncode == 2 and "TIERSTORE_PREFETCH_MAX_INFLIGHT='abc': expected an integer" in line


def test_a_bad_flag_value_is_one_line(tmp_path):
    r = _daemon(tmp_path, "--policy", "fifo")
    assert r.returncode == 2 and "--policy fifo: expected one of trace, lru" in _one_error_line(r)
    r = _daemon(tmp_path, "--no-such-flag")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--help" in r.stderr, r.stderr


def test_the_start_line_names_every_tier_in_human_units(daemon):
    """READY=1 comes once the daemon serves (journal replayed, arena mapped); a later
    STATUS= says the arena's pages are populated, with the same line."""
    ready = daemon.wait_for("READY=1")
    assert "host 64.0 MiB (shared memfd, being populated in the background)" in ready
    assert f"nvme 1.0 GiB in {daemon.nvme} (engine posix" in ready and "gpu none (" in ready
    populated = daemon.wait_for("memfd, populated in")
    assert "READY=1" not in populated and "host 64.0 MiB (shared memfd, populated in" in populated
    assert f"nvme 1.0 GiB in {daemon.nvme} (engine posix" in populated
    log = daemon.log.read_text()
    assert "settings: " in log and "(flag --host-bytes)" in log
    # served before the arena was populated
    assert log.index("being populated in the background") < log.index("host arena: 64.0 MiB")


def test_a_client_is_served_while_the_arena_is_populated(daemon_factory):
    """A host tier too big to populate in an instant: READY=1 before its pages are all
    there, a put and a get through the daemon meanwhile, the bytes exact."""
    import torch

    d = daemon_factory("--host-bytes", "2GiB")
    ready = d.wait_for("READY=1")
    assert "being populated in the background" in ready
    with d.client("early") as c:
        t = torch.arange(1 << 20, dtype=torch.float32)
        h = c.put(t, key="w")
        assert torch.equal(c.get(h), t)
    assert "populated in" in d.wait_for("shared memfd, populated in")


def test_an_unset_nvme_size_shrinks_to_the_free_space_and_says_so(tmpfs, caplog):
    from tierstore.preflight import check_start

    with caplog.at_level(logging.WARNING, "tierstore.preflight"):
        cfg = check_start(Config(nvme_dirs=[tmpfs], host_bytes="16MiB").resolved().store)
    assert 0 < cfg.nvme_bytes <= 24 << 20 and "has room for less than the default 64.0 GiB" in caplog.text


def test_a_set_nvme_size_beyond_the_free_space_is_refused_when_reserved_whole(tmpfs, tmp_path):
    """The data files are reserved whole at start (nvme_grow_bytes=0): a size the filesystem
    cannot hold is refused before the reservation could take all of its free space."""
    r = _daemon(tmp_path, "--nvme-dir", tmpfs, "--host-bytes", "16MiB", "--nvme-bytes", "10TiB",
                env={"TIERSTORE_NVME_GROW_BYTES": "0"})
    line = _one_error_line(r)
    assert r.returncode == 1 and "nvme_bytes is 10.0 TiB but the filesystem of" in line
    assert "lower nvme_bytes to at most 24.0 MiB" in line
    assert os.listdir(tmpfs) == ["lock"]  # nothing reserved


def test_a_set_nvme_size_beyond_the_free_space_is_a_warning_when_files_grow(tmpfs, caplog):
    from tierstore.preflight import check_start

    with caplog.at_level(logging.WARNING, "tierstore.preflight"):
        cfg = check_start(Config(nvme_dirs=[tmpfs], host_bytes="16MiB", nvme_bytes="10TiB",
                                 nvme_grow_bytes="1MiB").resolved().store)
    assert cfg.nvme_bytes == 10 << 40
    assert "nvme_bytes is 10.0 TiB but the filesystem of" in caplog.text and "lower nvme_bytes to at most 24.0 MiB" \
        in caplog.text


def test_a_start_warning_is_printed_once_through_the_cli(tmpfs, tmp_path):
    """``tierstore daemon`` checks before it execs the daemon, which checks before the
    store opens, which checks again: the refusals may come from any, a warning once."""
    cli = os.path.join(os.path.dirname(sys.executable), "tierstore")
    proc = subprocess.Popen([cli, "daemon", "--socket", str(tmp_path / "s" / "t.sock"), "--nvme-dir", tmpfs,
                             "--host-bytes", "16MiB", "--nvme-bytes", "10TiB", "--nvme-grow-bytes", "1MiB"],
                            stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "serving on" in line:
                break
    finally:
        proc.terminate()
        lines += proc.stderr.readlines()
        proc.wait(timeout=60)
    text = "".join(lines)
    assert "serving on" in text, text
    assert text.count("nvme_bytes is 10.0 TiB but the filesystem of") == 1, text


def test_a_file_where_the_nvme_dir_should_be_is_refused(tmp_path):
    from tierstore.preflight import check_start

    (tmp_path / "f").write_text("x")
    with pytest.raises(InvalidArgument, match="exists and is not a directory"):
        check_start(Config(nvme_dirs=[str(tmp_path / "f")], host_bytes="16MiB").resolved().store)


def test_arena_populates_later_when_asked(tmp_path):
    from tierstore.arena import Arena

    a = Arena(8 << 20, populate=False)
    try:
        assert not a.populated
        a.array[:4096] = 7  # touching before populate is correct, only slower
        a.populate()
        assert a.populated and a.array[0] == 7 and "MADV_POPULATE_WRITE" in a.populate_how
    finally:
        a.close()


def test_arena_populates_in_the_background_and_populate_waits_for_it():
    """``populate="background"``: pages are populated on a thread from the start (the
    daemon replays its journal meanwhile); ``populate()`` waits for it and reports its
    time from its start; bytes written meanwhile are kept (it populates without writing)."""
    from tierstore.arena import Arena

    a = Arena(64 << 20, populate="background")
    try:
        a.array[:4096] = 7
        a.array[-1] = 9
        seconds = a.populate()
        assert a.populated and seconds >= 0 and "MADV_POPULATE_WRITE" in a.populate_how
        assert a.array[0] == 7 and a.array[-1] == 9
        assert not [t for t in threading.enumerate() if t.name == "tierstore-populate"]
    finally:
        a.close()


def test_bytes_written_while_the_arena_is_made_huge_and_an_adopted_arenas_bytes_are_kept():
    """The populating makes the arena's pages huge (``MADV_COLLAPSE`` where shmem_enabled
    gives none at fault) while others write into it: the daemon's clients from the start,
    through their own mappings. Every byte written meanwhile, through another mapping of
    the memfd too, is there after; an arena handed back (systemd's fd store) keeps its
    bytes through its own populating."""
    import numpy as np

    from tierstore.arena import Arena, map_arena_fd

    size = 512 << 20
    a = Arena(size, populate="background")
    b = None
    try:
        other_mm, other = map_arena_fd(a.fd, size)  # (a client's mapping)
        rng = np.random.default_rng(3)
        pattern = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        written = []
        for i, off in enumerate(range(0, size, 3 << 20)):  # while the populating runs through the arena
            view = a.array if i % 2 else other
            view[off:off + pattern.nbytes] = np.roll(pattern, i)
            written.append((off, i))
        a.populate()
        if _collapses():
            assert a.huge()[0] > 0, a.huge()
        for off, i in written:
            assert np.array_equal(a.array[off:off + pattern.nbytes], np.roll(pattern, i)), off
            assert np.array_equal(other[off:off + pattern.nbytes], np.roll(pattern, i)), off
        del other, view
        other_mm.close()
        b = Arena(0, fd=os.dup(a.fd))  # handed back: populated again, made huge again where it is not
        assert b.adopted
        for off, i in written:
            assert np.array_equal(b.array[off:off + pattern.nbytes], np.roll(pattern, i)), off
        assert not b.array[(1 << 20):(3 << 20)].any()  # (what nobody wrote is still zero)
    finally:
        a.close()
        if b is not None:
            b.close()


def test_an_arena_closed_while_populating_in_the_background_stops_it():
    from tierstore.arena import Arena

    a = Arena(256 << 20, populate="background")
    a.close()  # (joins the populating thread; nothing is unmapped under it)
    assert not [t for t in threading.enumerate() if t.name == "tierstore-populate"]


def _shmem_thp_setting() -> str:
    """The setting in force for 2 MiB pages of shared memory (the per-size one unless it
    says ``inherit``)."""
    from tierstore.arena import _shmem_thp_setting

    return _shmem_thp_setting()


def _collapses() -> bool:
    """The arena's populating makes its huge pages (shmem_enabled ``never``, Linux 6.1+)."""
    kernel = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    return _shmem_thp_setting() == "never" and kernel >= (6, 1)


def _free_hugetlb_bytes() -> int:
    info = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
    return int(info.get("HugePages_Free", "0").split()[0]) * (int(info.get("Hugepagesize", "2048 kB").split()[0]) << 10)


def _thp_pages(view) -> tuple[int, int]:
    """(pages of ``view``'s mapping that are parts of transparent huge pages, pages) as the
    kernel says (``/proc/self/pagemap`` for each page's frame, ``/proc/kpageflags`` for its
    flags: root only)."""
    import struct

    page = os.sysconf("SC_PAGE_SIZE")
    start, n = view.ctypes.data // page, view.nbytes // page
    with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
        pm.seek(start * 8)
        entries = struct.unpack(f"{n}Q", pm.read(n * 8))
        thp = 0
        for e in entries:
            if e >> 63 and (pfn := e & ((1 << 55) - 1)):
                kf.seek(pfn * 8)
                thp += struct.unpack("Q", kf.read(8))[0] >> 22 & 1  # KPF_THP
    return thp, n


def test_the_arena_gets_transparent_huge_pages_and_says_what_it_got():
    """The host arena is advised into transparent huge pages before its pages exist; where
    ``shmem_enabled`` gives shared memory none when pages fault in (``never``, the usual
    default), the populating makes them (``MADV_COLLAPSE``) — and the kernel's own page
    flags show the arena's pages are huge pages. The arena says how much it got and, where
    none, which setting to change. ``off`` asks for none and gets none."""
    from tierstore.arena import Arena

    a, off = Arena(16 << 20), Arena(16 << 20, huge_pages="off")
    tiny = Arena(1 << 20)
    try:
        if _collapses():
            assert tiny.huge() == (0, "none: the arena (1.0 MiB) is smaller than one huge page")
        got, how = a.huge()
        setting = _shmem_thp_setting()
        if setting in ("always", "within_size", "advise", "force"):
            # (the kernel may have no free 2 MiB of contiguous memory to give: then it says so)
            assert (got > 0 and "transparent huge pages" in how) or (got == 0 and "too fragmented" in how), how
        elif _collapses():
            assert got == 16 << 20 and "made by MADV_COLLAPSE (shmem_enabled: never" in how, how
            assert "16.0 MiB made huge pages by MADV_COLLAPSE" in a.populate_how
        else:
            assert got == 0 and f"shmem_enabled: {setting}" in how and "hugetlb" in how
        assert off.huge() == (0, "none: host_huge_pages = 'off'")
        if os.geteuid() == 0 and os.path.exists("/proc/kpageflags"):
            assert _thp_pages(a.array)[0] == (got >> 12), (_thp_pages(a.array), got)
            assert _thp_pages(off.array)[0] == 0
    finally:
        a.close()
        off.close()
        tiny.close()


def test_a_hugetlb_arena_takes_reserved_huge_pages_or_says_how_many_it_needs():
    """``huge_pages="hugetlb"``: the arena is a hugetlb memfd, its size rounded up to whole
    huge pages; where the kernel has not that many reserved, the error says how many."""
    from tierstore import CapacityExceeded
    from tierstore.arena import Arena

    if _free_hugetlb_bytes() >= 8 << 20:
        a = Arena((6 << 20) + 1, huge_pages="hugetlb")
        try:
            assert a.size == 8 << 20 and a.huge()[0] == 8 << 20 and "hugetlb" in a.huge()[1]
            a.array[-1] = 5
            assert a.array[-1] == 5
        finally:
            a.close()
    else:
        free = _free_hugetlb_bytes()
        with pytest.raises(CapacityExceeded, match=r"needs \d+ reserved huge pages .*vm.nr_hugepages"):
            Arena((free + (8 << 20)), huge_pages="hugetlb")


def _vm_flags(addr: int) -> set[str]:
    """The ``VmFlags`` of this process's mapping that starts at ``addr`` (``/proc/self/smaps``)."""
    lines = open("/proc/self/smaps").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.split("-", 1)[0] == format(addr, "x"))
    flags = next(line for line in lines[start + 1:] if line.startswith("VmFlags:"))
    return set(flags.split()[1:])


def test_a_client_maps_the_arena_asking_for_the_huge_pages_the_daemon_asks_for(daemon_factory):
    """The kernel gives a page of shared memory the size that the first mapping to touch
    it asks for, and a client connects as soon as the daemon serves, while the daemon
    still populates its arena (with a large arena, for seconds): a page the client's
    prefault or its first views touch first would be allocated small, out of the huge
    pages the daemon asked for. So a client maps the arena with ``MADV_HUGEPAGE`` (both of
    its mappings, flag ``hg``) when hello's ``arena_huge`` says the daemon does, and not
    when the daemon runs with ``host_huge_pages = "off"``."""
    for mode, huge in (("auto", True), ("off", False)):
        d = daemon_factory("--host-bytes", "64MiB", "--host-huge-pages", mode)
        with d.client("early") as c:
            assert c.server["arena_huge"] is huge
            for view in (c._arena, c._arena_ro):
                assert ("hg" in _vm_flags(view.ctypes.data)) is huge, mode
        d.stop()


def test_a_daemon_on_reserved_huge_pages_serves_clients_that_map_them(daemon_factory):
    """End to end where the machine has huge pages reserved (``vm.nr_hugepages``): a
    daemon whose arena is hugetlb, a client that maps it, puts, gets and checks out
    through it, and ``stat`` saying so."""
    import torch

    if _free_hugetlb_bytes() < 64 << 20:
        pytest.skip("fewer than 64 MiB of huge pages reserved (vm.nr_hugepages)")
    d = daemon_factory("--host-huge-pages", "hugetlb")
    t = torch.arange(1 << 20, dtype=torch.float32)
    with d.client("huge") as c:
        host = c.stat()["tiers"]["host"]
        assert host["huge_page_bytes"] == 64 << 20 and "hugetlb" in host["huge_pages"]
        h = c.put(t, key="w")
        assert torch.equal(c.get(h), t)
        with c.checkout(h, "w") as view:
            view.add_(1)
        assert torch.equal(c.get(h), t + 1)
        kept = c.checkout(h, "w").tensor  # held past the client's end
    # its mapping was detached from the pool (a private mapping that reserves no huge page):
    # the view still reads, and a write through it reaches no one
    assert torch.equal(kept, t + 1)
    kept[:4].fill_(-1.0)
    with d.client("huge") as c:
        assert torch.equal(c.get(c.lookup("w")), t + 1)


def _twelve(s, tier_dirs_note=""):
    """12 durable 4 MiB objects on NVMe (48 MiB of extents); their values by key."""
    import numpy as np

    vals = {}
    for i in range(12):
        vals[f"k{i}"] = np.random.default_rng(i).integers(0, 255, 4 << 20, dtype=np.uint8)
        s.put(vals[f"k{i}"], key=f"k{i}", durable=True, tier="nvme")
    return vals


def _all_there(s, vals):
    import numpy as np

    assert sorted(s.keys()) == sorted(vals)
    for k, v in vals.items():
        assert np.array_equal(np.asarray(s.get(s.lookup(k))), v), k


def test_a_smaller_nvme_size_at_restart_keeps_every_durable_object(tmp_path, caplog):
    """nvme_bytes lowered below what the data file already holds: the tier keeps the file's
    size (with a warning), and no object in it is dropped — not at this start, nor later."""
    from tierstore import Store

    d = str(tmp_path / "nvme")

    def cfg(size):
        return Config(host_bytes="8MiB", nvme_bytes=size, nvme_dirs=[d], io_chunk_bytes="1MiB",
                      nvme_grow_bytes="4MiB")
    with Store(cfg("64MiB")) as s:
        vals = _twelve(s)
    with caplog.at_level(logging.WARNING, "tierstore.preflight"):
        with Store(cfg("32MiB")) as s:
            _all_there(s, vals)
            assert s.replay_info["malformed_records"] == 0 and s.stat()["tiers"]["nvme"]["capacity_bytes"] >= 48 << 20
    assert "from an earlier, larger tier: using 48.0 MiB" in caplog.text
    with Store(cfg("64MiB")) as s:
        _all_there(s, vals)


def test_an_unset_nvme_size_keeps_its_objects_when_others_fill_the_filesystem(tmpfs):
    """An unset nvme_bytes follows the filesystem's free room, which another file takes
    between two starts: the tier still covers its data file, and every object is kept."""
    from tierstore import Store

    d = os.path.join(tmpfs, "nvme")
    with Store(Config(host_bytes="8MiB", nvme_dirs=[d], io_chunk_bytes="1MiB", nvme_grow_bytes="4MiB")) as s:
        first = s.stat()["tiers"]["nvme"]["capacity_bytes"]
        vals = {}
        import numpy as np
        for i in range(first // (1 << 20) - 2):  # the tier nearly full
            vals[f"k{i}"] = np.full(1 << 20, i, np.uint8)
            s.put(vals[f"k{i}"], key=f"k{i}", durable=True, tier="nvme")
    st = os.statvfs(tmpfs)
    with open(os.path.join(tmpfs, "other"), "wb") as f:  # someone else's file takes most of what is left
        f.write(b"\0" * (st.f_bavail * st.f_frsize * 3 // 4))
    with Store(Config(host_bytes="8MiB", nvme_dirs=[d], io_chunk_bytes="1MiB", nvme_grow_bytes="4MiB")) as s:
        _all_there(s, vals)
        assert s.replay_info["malformed_records"] == 0


def test_a_start_with_other_nvme_directories_is_refused_and_the_journal_kept(tmp_path):
    """Objects striped over two directories, then starts that name only the first (it
    holds the journal), the two swapped, or a third added: each refused, in one line
    saying what to do (by the directories' tier.id; without one, by the journal's
    extents, or where the journal and the data are), with the journal and data files left
    as they were; the start with both directories in order again has every object."""
    from tierstore import InvalidArgument, Store

    a, b = str(tmp_path / "a"), str(tmp_path / "b")

    def cfg(dirs):
        return Config(host_bytes="8MiB", nvme_bytes="128MiB", nvme_dirs=dirs, io_chunk_bytes="1MiB",
                      nvme_grow_bytes="4MiB")
    with Store(cfg([a, b])) as s:
        vals = _twelve(s)
    journal = open(os.path.join(a, "journal.log"), "rb").read()
    data = [open(os.path.join(x, "data.bin"), "rb").read() for x in (a, b)]
    os.remove(os.path.join(a, "index.ckpt"))  # (the journal alone: the checkpoint is refused likewise)
    for dirs, why in [([a], "is directory 1 of 2 of its tier, but this start names it as 1 of 1"),
                      ([b, a], "is directory 2 of 2 of its tier, but this start names it as 1 of 2"),
                      ([a, b, str(tmp_path / "c")], "is directory 1 of 2 of its tier, but this start names it as 1 of 3"),
                      ([str(tmp_path / "c"), b], "has no tier.id, but the others named with it belong to a tier")]:
        with pytest.raises(InvalidArgument, match=why):
            Store(cfg(dirs))
    for x in (a, b):  # a tier of a version that wrote no tier.id: the journal itself refuses
        os.remove(os.path.join(x, "tier.id"))
    with pytest.raises(InvalidArgument, match="start with the nvme_dirs, in the same order, and the nvme_bytes"):
        Store(cfg([a]))
    # ... and so do where the journal is, and where the data is without one
    for dirs, why in [([b, a], "holds objects' data .data.bin. but no journal"),
                      ([b], "holds objects' data .data.bin. but no journal"),
                      ([str(tmp_path / "c"), a], "holds journal.log, which only a tier's first directory has")]:
        with pytest.raises(InvalidArgument, match=why):
            Store(cfg(dirs))
    assert not os.path.exists(os.path.join(b, "journal.log")) and not os.path.exists(os.path.join(a, "tier.id"))
    # a first start stopped after reserving its data file, before its journal: nothing written, so a new tier
    fresh = str(tmp_path / "fresh")
    os.makedirs(fresh)
    fd = os.open(os.path.join(fresh, "data.bin"), os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 64 << 20)
    os.close(fd)
    with Store(cfg([fresh])) as s:
        s.put(np.ones(4, np.float32), key="first", durable=True)
    assert open(os.path.join(a, "journal.log"), "rb").read() == journal
    assert [open(os.path.join(x, "data.bin"), "rb").read() for x in (a, b)] == data
    assert not [n for n in os.listdir(a) if "damaged" in n]
    with Store(cfg([a, b])) as s:
        _all_there(s, vals)
        assert s.replay_info["malformed_records"] == 0
    with open(os.path.join(b, "tier.id"), "w") as f:  # damaged: refused, never rewritten
        f.write("{not json")
    with pytest.raises(InvalidArgument, match="tier.id is damaged"):
        Store(cfg([a, b]))


@pytest.mark.parametrize("case", ["another uid's", "writable by others", "a link to another uid's"])
def test_a_socket_directory_others_may_write_is_refused(tmp_path, case):
    """Whoever may rename names in the socket's directory could swap the socket for a link
    between its bind and the chown that gives it to the allowed group (turning root's chown
    onto a file of their choosing), or put a socket of their own in its place: a directory
    another uid owns, or one others may write without the sticky bit, is refused in one
    line, nothing made in it."""
    import pwd

    if os.geteuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    nobody = pwd.getpwnam("nobody")
    d = tmp_path / "s"
    if case == "a link to another uid's":
        real = tmp_path / "theirs"
        real.mkdir(mode=0o700)
        os.chown(real, nobody.pw_uid, nobody.pw_gid)
        os.symlink(real, d)
    else:
        d.mkdir()
        if case == "another uid's":
            os.chmod(d, 0o755)
            os.chown(d, nobody.pw_uid, nobody.pw_gid)
        else:
            os.chmod(d, 0o777)
    r = _daemon(tmp_path, "--nvme-dir", str(tmp_path / "n"), "--host-bytes", "64MiB")
    line = _one_error_line(r)
    assert r.returncode == 1 and f"socket directory {d}" in line, line
    assert ("belongs to uid" if case != "writable by others" else "others may replace") in line
    assert os.listdir(d) == []
    # refused by the checks before the store: no journal replayed, no NVMe directory made
    assert "store open" not in r.stderr and not (tmp_path / "n").exists(), r.stderr[-2000:]


def test_a_socket_path_too_long_is_refused_before_the_store_opens(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    r = subprocess.run([sys.executable, "-m", "tierstore.daemon", "--socket", str(deep / "t.sock"), "--nvme-dir",
                        str(tmp_path / "n"), "--host-bytes", "64MiB"], capture_output=True, text=True, timeout=60)
    line = _one_error_line(r)
    assert r.returncode == 1 and "longer than a Unix socket's 107" in line and "--socket" in line, line
    assert "store open" not in r.stderr and not (tmp_path / "n").exists(), r.stderr[-2000:]


def test_sighup_stops_the_daemon_cleanly_with_its_checkpoint(daemon_factory):
    """The terminal of a daemon run in the foreground closes (SIGHUP): a clean stop, as
    SIGTERM's — exit 0, the index checkpoint written, the socket removed — not a death."""
    import signal

    d = daemon_factory()
    with d.client("hup") as c:
        c.put(torch.ones(4), key="k", durable=True)
    d.proc.send_signal(signal.SIGHUP)
    assert d.proc.wait(timeout=60) == 0
    log = d.log.read_text()
    assert "received SIGHUP" in log and not os.path.exists(d.socket)
    assert os.path.exists(os.path.join(d.nvme, "index.ckpt"))
    d.messages.clear()
    d.start()
    with d.client("hup") as c:
        assert torch.equal(c.get(c.lookup("k")), torch.ones(4))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_while_the_daemon_starts_ends_it_with_a_line_not_a_traceback(daemon_factory, sig):
    """Sent at several moments of the start (from its first log line on: during the
    checks, while the store opens, once serving): every one ends the daemon with a line
    saying why — ``received SIG... while starting: not started`` and status 128 + the
    signal, or a clean stop (0) — never a traceback or a death without a word; a start
    after that opens with what was there."""
    import signal
    import time

    num = getattr(signal, sig)
    d = daemon_factory(start=False)
    for delay in (0.0, 0.05, 0.15, 0.3, 0.6):
        d.start(expect_ready=False)
        # (from its first line on: before it, the interpreter itself is still starting)
        deadline = time.monotonic() + 60
        while "settings:" not in d.log.read_text() and d.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay)
        d.proc.send_signal(num)
        rc = d.proc.wait(timeout=60)
        log = d.log.read_text()
        assert "Traceback" not in log, log[-3000:]
        assert rc == 0 and f"received {sig}" in log or rc == 128 + num and "while starting: not started" in log, \
            (delay, rc, log[-2000:])
        d.logf.close()
        d.log.write_text("")
        _drain(d)  # (a full datagram queue would block the next daemon's notifications)
    d.messages.clear()
    d.start()
    with d.client("after") as c:
        c.ping()


def _drain(d):
    """Read what the daemons so far told the notify socket (READY=1 among it is not the
    next start's)."""
    d.notify.setblocking(False)
    while True:
        try:
            d.notify.recv(4096)
        except BlockingIOError:
            break
    d.notify.settimeout(0.05)


def test_an_engine_that_cannot_run_here_is_a_one_line_refusal(daemon_factory):
    from tierstore.engine import kvikio_engine

    if kvikio_engine.detect()[0]:
        pytest.skip("kvikio works here")
    d = daemon_factory("--engine", "kvikio", start=False)
    d.start(expect_ready=False)
    assert d.proc.wait(timeout=60) == 1
    log = d.log.read_text()
    assert "Traceback" not in log and "engine=kvikio requested but unusable here" in log, log[-2000:]


def test_a_daemon_started_with_sighup_ignored_keeps_it_ignored(daemon_factory):
    """``nohup tierstore daemon &``: the hang-up nohup ignores does not stop the daemon."""
    import signal

    d = daemon_factory(start=False)
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (inherited through exec, as nohup does it)
    try:
        d.start()
    finally:
        signal.signal(signal.SIGHUP, old)
    d.proc.send_signal(signal.SIGHUP)
    for _ in range(20):
        with d.client("nohup") as c:
            c.ping()
    assert d.proc.poll() is None and "received SIGHUP" not in d.log.read_text()


def test_one_directory_named_twice_is_refused_naming_it(tmp_path):
    d = tmp_path / "nvme"
    d.mkdir()
    os.symlink(d, tmp_path / "again")
    for dirs in ([str(d), str(d) + "/"], [str(d), str(tmp_path / "again")]):
        with pytest.raises(InvalidArgument, match="names one directory twice"):
            Store(Config(host_bytes="4MiB", nvme_bytes="64MiB", nvme_dirs=dirs))
