"""How much of an NVMe path's speed comes from where its data file lies.

Several in-process stores with the same settings, each with its own data file, put
the same ordinary (unaligned) tensor to NVMe and read it back with ``get(out=)``, in
rotating order, the page cache dropped before each read (root; elsewhere the reads
may come from the cache, and the table says so). On a real NVMe drive every file
moves bytes at one speed; on a virtual disk they can differ by more than the gap
between two I/O engines, and a comparison of two engines (or of the tier with
DeepSpeed's aio, ``bench/nvme_paths.py``) carries that difference. With ``--configs``
each store gets its own chunk size and thread count instead, in the order given. With
``--chunks`` one store (one file, whose freed extents each put reuses) alternates the
NVMe tier's chunk size between puts, for an ordinary (unaligned) tensor and a
page-aligned one: chunk sizes compared on the same bytes of the disk. With
``--same-blocks`` the tier and DeepSpeed's aio (its ZeRO-Infinity default: 1 MiB
blocks, queue depth 8, one thread, page-locked buffer; and the deep configuration
``io_throughput.py`` finds fastest: 8 MiB blocks, queue depth 32, 8 threads; run under
``--deepspeed-python``) take turns on the same blocks of the same file: one store puts an object, reads it
back and frees it, and the DeepSpeed peer writes and reads the same bytes of the
store's data file where that object lay (its freed extent, which the store's next put
takes again) — an ordinary tensor, a page-aligned one, and a ``checkout("r")`` (read
into the host tier) against DeepSpeed on identical disk blocks, in rotating order.

    python bench/nvme_files.py --stores 4 --size 1GiB --rounds 5
    python bench/nvme_files.py --configs 16x16,1x8,4x8 --size 1GiB --rounds 5
    python bench/nvme_files.py --chunks 16,2,1 --size 1GiB --rounds 5
    python bench/nvme_files.py --same-blocks --deepspeed-python ~/ds-venv/bin/python --size 1GiB --rounds 5
    python bench/nvme_files.py --memory --size 1GiB --rounds 4

``--memory`` leaves the tier out: raw O_DIRECT reads and writes of one file (the
engine's defaults: 16 requests of 16 MiB in flight, one thread each) from and into
buffers of each kind of memory a transfer may use — private or shared (a ``memfd``,
as the host arena is), in 4 KiB pages or huge pages (transparent where the kernel
gives them; ``hugetlb`` where ``vm.nr_hugepages`` has enough reserved) — alternated
over rounds, with the drive's limits on a request (``max_segments``,
``max_sectors_kb``): how much of a transfer's speed comes from its memory being
physically contiguous (docs/store.md, "Huge pages for the host tier").
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import emit_json, machine, print_table  # noqa: E402
from nvme_paths import drop_caches  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from tierstore.units import format_size, parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="./bench-io-tmp", help="directory on the drive to test")
    ap.add_argument("--stores", type=int, default=4, help="stores with the engine's default settings")
    ap.add_argument("--configs", default="", help="CHUNK_MIBxTHREADS per store instead, e.g. 16x16,1x8")
    ap.add_argument("--chunks", default="", help="CHUNK_MIB,...: one store, its chunk size alternated")
    ap.add_argument("--same-blocks", action="store_true", help="the tier and DeepSpeed's aio on the same blocks")
    ap.add_argument("--memory", action="store_true", help="raw O_DIRECT from and into each kind of memory")
    ap.add_argument("--deepspeed-python", default=sys.executable, help="an interpreter where deepspeed imports")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds after a warm-up round")
    ap.add_argument("--quick", action="store_true", help="2 stores, 8 MiB, 2 rounds (smoke test)")
    a = ap.parse_args(argv)
    if a.quick:
        a.stores, a.size, a.rounds, a.configs = 2, "8MiB", 2, ""
        a.chunks = "2,1" if a.chunks else ""
    import numpy as np
    import torch

    from tierstore import Config, Store

    n = parse_size(a.size)
    if a.same_blocks:
        return _same_blocks(a, n)
    if a.memory:
        return _memory_kinds(a, n)
    if a.chunks:
        return _same_file(a, n, [int(c) << 20 for c in a.chunks.split(",")])
    configs = [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",")] if a.configs else [None] * a.stores
    base = os.path.join(os.path.abspath(a.dir), f"nvme-files-{os.getpid()}")
    stores = []
    try:
        for i, c in enumerate(configs):
            d = os.path.join(base, f"store{i}")
            os.makedirs(d)
            kw = {} if c is None else {"io_chunk_bytes": c[0] << 20, "io_threads": c[1]}
            stores.append(Store(Config(host_bytes=64 << 20, nvme_dirs=[d], nvme_bytes=max(2 * n, 256 << 20), **kw)))
        src = torch.empty(n, dtype=torch.uint8)
        src.numpy()[:] = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        out = torch.empty(n, dtype=torch.uint8)
        out.fill_(0)
        kept: dict[int, object | None] = {}
        times: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(stores))}
        dropped = True
        for r in range(a.rounds + 1):
            k = r % len(stores)
            for i in list(range(len(stores)))[k:] + list(range(len(stores)))[:k]:
                kept[i], w, g, cached = _put_get(stores[i], kept.get(i), src, out, f"store {i}")
                dropped = dropped and not cached
                if r:
                    times[i].append((w, g))
        rows, results = [], []
        for i, v in times.items():
            c = configs[i]
            label = "defaults" if c is None else f"{c[0]} MiB x {c[1]}"
            cells, rates = _rates(n, v)
            rows.append([i, label, *cells])
            results.append({"store": i, "settings": label, **rates})
        print(f"# nvme_files on {machine()}: {len(stores)} stores, {format_size(n)}, {a.rounds} rounds after a "
              f"warm-up, {'page cache dropped before reads' if dropped else 'page cache NOT dropped (not root)'}")
        print_table(["store", "settings", "put GB/s", "range", "get(out=) GB/s", "range"], rows)
        emit_json({"bench": "nvme_files", "machine": machine(), "size": n, "rounds": a.rounds,
                   "cache_dropped": dropped, "results": results})
    finally:
        for s in stores:
            s.close()
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _same_file(a: argparse.Namespace, n: int, chunks: list[int]) -> int:
    """One store; each round puts and reads back both tensors at every chunk size, in rotating order."""
    import numpy as np
    import torch

    from tierstore import Config, Store
    from tierstore.tensors import aligned_empty
    from tierstore.units import format_size

    base = os.path.join(os.path.abspath(a.dir), f"nvme-files-{os.getpid()}")
    os.makedirs(base)
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    bufs = {}
    for kind, make in (("unaligned", lambda: torch.empty(n, dtype=torch.uint8)),
                       ("page-aligned", lambda: torch.from_numpy(aligned_empty(n)))):
        src, out = make(), make()
        src.numpy()[:] = data
        out.fill_(0)
        bufs[kind] = (src, out)
    variants = [(k, c) for k in bufs for c in chunks]
    times: dict[tuple[str, int], list[tuple[float, float]]] = {v: [] for v in variants}
    dropped = True
    # (made at the largest chunk: its staging buffers are that size)
    s = Store(Config(host_bytes=64 << 20, nvme_dirs=[base], nvme_bytes=max(2 * n, 256 << 20),
                     io_chunk_bytes=max(chunks)))
    try:
        h = None
        for r in range(a.rounds + 1):
            k = r % len(variants)
            for kind, chunk in variants[k:] + variants[:k]:
                src, out = bufs[kind]
                s.nvme.chunk_bytes = chunk  # (the tier reads it per transfer)
                h, w, g, cached = _put_get(s, h, src, out, f"{kind} at chunk {chunk}")
                dropped = dropped and not cached
                if r:
                    times[(kind, chunk)].append((w, g))
    finally:
        s.close()
        shutil.rmtree(base, ignore_errors=True)
    rows, results = [], []
    for (kind, chunk), v in times.items():
        cells, rates = _rates(n, v)
        rows.append([kind, f"{chunk >> 20} MiB", *cells])
        results.append({"source": kind, "chunk": chunk, **rates})
    print(f"# nvme_files on {machine()}: one store, chunk sizes alternated, {format_size(n)}, {a.rounds} rounds "
          f"after a warm-up, {'page cache dropped before reads' if dropped else 'page cache NOT dropped (not root)'}")
    print_table(["tensor", "chunk", "put GB/s", "range", "get(out=) GB/s", "range"], rows)
    emit_json({"bench": "nvme_files", "machine": machine(), "size": n, "rounds": a.rounds, "same_file": True,
               "cache_dropped": dropped, "results": results})
    return 0


def _same_blocks(a: argparse.Namespace, n: int) -> int:
    """The tier's paths and DeepSpeed's aio on one extent of one data file, in turns."""
    import numpy as np
    import torch

    from aio_peer import AioPeer
    from tierstore import Config, Store
    from tierstore.tensors import aligned_empty
    from tierstore.units import format_size

    peer = AioPeer.start(a.deepspeed_python, 1 << 20, 8, 1, n)
    if isinstance(peer, str):
        raise SystemExit(f"--same-blocks needs DeepSpeed's aio: {peer}")
    deep = AioPeer.start(a.deepspeed_python, 8 << 20, 32, 8, n)  # (the fastest configuration io_throughput finds)
    if isinstance(deep, str):
        peer.close()
        raise SystemExit(f"--same-blocks needs DeepSpeed's aio: {deep}")
    base = os.path.join(os.path.abspath(a.dir), f"nvme-files-{os.getpid()}")
    os.makedirs(base)
    s = Store(Config(host_bytes=n + (64 << 20), nvme_dirs=[base], nvme_bytes=2 * n + (64 << 20)))
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    unaligned, aligned = torch.empty(n, dtype=torch.uint8), torch.from_numpy(aligned_empty(n))
    unaligned.numpy()[:] = data
    aligned.numpy()[:] = data
    outs = {"unaligned": torch.empty(n, dtype=torch.uint8), "page-aligned": torch.from_numpy(aligned_empty(n))}
    path = os.path.join(base, "data.bin")
    times: dict[str, list[float]] = {}
    dropped = True

    def where(h) -> list[tuple[int, int]]:
        # (the benchmark reads where the tier put the object: an internal it has no API for)
        return [(e.file_offset, e.nbytes) for e in s.index.get_meta(h, s.namespace).nvme]

    h = s.put(aligned, tier="nvme")
    extent = where(h)
    s.free(h)
    if len(extent) != 1:
        raise SystemExit(f"the object lies in {len(extent)} extents; --same-blocks needs one")

    def tier(kind: str, src) -> dict[str, float]:
        nonlocal dropped
        t0 = time.perf_counter()
        h = s.put(src, tier="nvme")
        w = time.perf_counter() - t0
        if where(h) != extent:
            raise SystemExit(f"the put took {where(h)}, not the extent {extent} it was to reuse")
        dropped = drop_caches() and dropped
        out = outs[kind]
        t0 = time.perf_counter()
        s.get(h, out=out)
        g = time.perf_counter() - t0
        if not torch.equal(out, src):
            raise SystemExit(f"{kind}: get(out=) read back wrong bytes")
        s.free(h)
        return {f"put {kind}": w, f"get(out=) {kind}": g}

    def checkout() -> dict[str, float]:
        h = s.put(aligned, tier="nvme")
        drop_caches()
        t0 = time.perf_counter()
        lease = s.checkout(h, "r")
        c = time.perf_counter() - t0
        ok = torch.equal(lease.tensor[-4096:], aligned[-4096:])
        lease.release()
        s.free(h)
        if not ok:
            raise SystemExit("checkout(\"r\") read back wrong bytes")
        return {'checkout("r")': c}

    def deepspeed(p: AioPeer, name: str) -> dict[str, float]:
        w = p.write(n, path, extent[0][0])
        drop_caches()
        return {f"{name} write": w, f"{name} read": p.read(n, path, extent[0][0])}

    variants = [lambda: tier("unaligned", unaligned), lambda: tier("page-aligned", aligned), checkout,
                lambda: deepspeed(peer, "DeepSpeed"), lambda: deepspeed(deep, "DeepSpeed deep")]
    try:
        for r in range(a.rounds + 1):
            k = r % len(variants)
            for fn in variants[k:] + variants[:k]:
                for name, dt in fn().items():
                    if r:  # round 0 warms up
                        times.setdefault(name, []).append(dt)
    finally:
        s.close()
        peer.close()
        deep.close()
        shutil.rmtree(base, ignore_errors=True)
    rows, results = [], []
    for name, v in times.items():
        reading = "get" in name or "checkout" in name or "read" in name
        rates = [n / t / 1e9 for t in v]
        ratios = [statistics.median(d / t for d, t in zip(times[f"{peer_name} {'read' if reading else 'write'}"], v))
                  for peer_name in ("DeepSpeed", "DeepSpeed deep")]
        rows.append([name, f"{statistics.median(rates):.2f}", f"{min(rates):.2f}-{max(rates):.2f}",
                     f"{ratios[0]:.2f}", f"{ratios[1]:.2f}"])
        results.append({"path": name, "gbps": rates, "vs_deepspeed": ratios[0], "vs_deepspeed_deep": ratios[1]})
    print(f"# nvme_files --same-blocks on {machine()}: {format_size(n)} at offset {extent[0][0]} of one data file, "
          f"{a.rounds} rounds after a warm-up, DeepSpeed {peer.version} aio 1 MiB x qd8 x 1 thread and "
          "(deep) 8 MiB x qd32 x 8 threads; "
          f"{'page cache dropped before reads' if dropped else 'page cache NOT dropped (not root)'}; "
          f"host arena huge pages: {format_size(s.arena.huge()[0])}")
    print_table(["path", "GB/s", "range", "x DeepSpeed (median of rounds)", "x DeepSpeed deep"], rows)
    emit_json({"bench": "nvme_files", "machine": machine(), "size": n, "rounds": a.rounds, "same_blocks": True,
               "cache_dropped": dropped, "results": results})
    return 0


def _memory_kinds(a: argparse.Namespace, n: int) -> int:
    """Raw O_DIRECT of one file from and into each kind of memory, alternated over rounds."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from tierstore.arena import _read_text
    from tierstore.units import format_size

    chunk, depth = 16 << 20, 16
    n = max(chunk, n // chunk * chunk)
    kinds: dict[str, mmap.mmap] = {}
    skipped: dict[str, str] = {}

    def touch(m: mmap.mmap) -> mmap.mmap:
        for off in range(0, n, mmap.PAGESIZE):
            m[off] = 1
        return m

    kinds["private, 4 KiB pages"] = touch(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    kinds["private, MADV_HUGEPAGE"] = touch(m)
    fd = os.memfd_create("nvme-files")
    os.ftruncate(fd, n)
    kinds["memfd, 4 KiB pages"] = touch(mmap.mmap(fd, n, flags=mmap.MAP_SHARED))
    os.close(fd)
    fd = os.memfd_create("nvme-files")
    os.ftruncate(fd, n)
    m = mmap.mmap(fd, n, flags=mmap.MAP_SHARED)
    m.madvise(mmap.MADV_HUGEPAGE)
    kinds["memfd, MADV_HUGEPAGE"] = touch(m)
    os.close(fd)
    try:
        fd = os.memfd_create("nvme-files", os.MFD_HUGETLB)
        os.ftruncate(fd, n)
        kinds["memfd, hugetlb"] = touch(mmap.mmap(fd, n, flags=mmap.MAP_SHARED))
        os.close(fd)
    except OSError as e:
        skipped["memfd, hugetlb"] = f"{e.strerror} (reserve huge pages: vm.nr_hugepages)"
    base = os.path.join(os.path.abspath(a.dir), f"nvme-files-{os.getpid()}")
    os.makedirs(base)
    path = os.path.join(base, "raw.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    views = {k: memoryview(m) for k, m in kinds.items()}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    dropped = True
    try:
        with ThreadPoolExecutor(depth) as pool:
            def move(buf: memoryview, write: bool) -> float:
                t0 = time.perf_counter()
                io = os.pwritev if write else os.preadv
                for f in [pool.submit(io, fd, [buf[o:o + chunk]], o) for o in range(0, n, chunk)]:
                    f.result()
                return time.perf_counter() - t0

            move(views["private, 4 KiB pages"], True)  # the file's extents written once: the rounds overwrite
            os.fsync(fd)
            names = list(kinds)
            for r in range(a.rounds + 1):
                k = r % len(names)
                for name in names[k:] + names[:k]:
                    w = move(views[name], True)
                    dropped = drop_caches() and dropped
                    rd = move(views[name], False)
                    if r:
                        times[name].append((w, rd))
    finally:
        os.close(fd)
        shutil.rmtree(base, ignore_errors=True)
        for v in views.values():
            v.release()
    dev = _block_device_of(a.dir)
    limits = {k: _read_text(f"/sys/block/{dev}/queue/{k}") for k in ("max_segments", "max_segment_size",
                                                                      "max_sectors_kb")} if dev else {}
    rows, results = [], []
    for name, v in times.items():
        cells, rates = _rates(n, v)
        rows.append([name, *cells])
        results.append({"memory": name, **rates})
    print(f"# nvme_files --memory on {machine()}: {format_size(n)}, {depth} x {format_size(chunk)} O_DIRECT requests "
          f"in flight, {a.rounds} rounds after a warm-up; drive {dev or '?'} {limits}; transparent huge pages: "
          f"private {_read_text('/sys/kernel/mm/transparent_hugepage/enabled')!r}, shared "
          f"{_read_text('/sys/kernel/mm/transparent_hugepage/shmem_enabled')!r}; "
          f"{'page cache dropped before reads' if dropped else 'page cache NOT dropped (not root)'}")
    print_table(["memory", "write GB/s", "range", "read GB/s", "range"], rows)
    for name, why in skipped.items():
        print(f"# {name}: skipped: {why}")
    emit_json({"bench": "nvme_files", "machine": machine(), "size": n, "rounds": a.rounds, "memory": True,
               "queue_limits": limits, "cache_dropped": dropped, "results": results, "skipped": skipped})
    return 0


def _block_device_of(directory: str) -> str | None:
    """The whole disk under ``directory`` (its sysfs name), for its queue limits."""
    try:
        st = os.stat(directory if os.path.exists(directory) else ".")
        link = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    except OSError:
        return None
    if os.path.exists(os.path.join(link, "partition")):
        link = os.path.dirname(link)
    return os.path.basename(link) if os.path.isdir(os.path.join(link, "queue")) else None


def _put_get(s, old, src, out, what: str) -> tuple[object, float, float, bool]:
    """Free ``old`` (the last round's object, or None), put ``src`` to NVMe, drop the page
    cache, read it back into ``out``: (handle, put s, get s, whether the cache stayed)."""
    import torch

    if old is not None:
        s.free(old)
    t0 = time.perf_counter()
    h = s.put(src, tier="nvme")
    w = time.perf_counter() - t0
    cached = not drop_caches()
    t0 = time.perf_counter()
    s.get(h, out=out)
    g = time.perf_counter() - t0
    if not torch.equal(out, src):
        raise SystemExit(f"{what} read back wrong bytes")
    return h, w, g, cached


def _rates(n: int, times: list[tuple[float, float]]) -> tuple[list[str], dict[str, list[float]]]:
    """A row's cells (median and range of put and get GB/s) and the rates themselves."""
    put = [n / w / 1e9 for w, _ in times]
    get = [n / g / 1e9 for _, g in times]
    cells = [f"{statistics.median(put):.2f}", f"{min(put):.2f}-{max(put):.2f}",
             f"{statistics.median(get):.2f}", f"{min(get):.2f}-{max(get):.2f}"]
    return cells, {"put_gbps": put, "get_gbps": get}


if __name__ == "__main__":
    sys.exit(main())
