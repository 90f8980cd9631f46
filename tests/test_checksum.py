"""The block checksum: both CRC32C implementations agree, and a store written under one
is read, and its damage caught, under the other."""

import json
import mmap
import os
import subprocess
import sys

import pytest

import crc32c as reference

from tierstore import checksum

_IMPLS = ("fastcrc", "crc32c")


def _run(impl: str, code: str, *args: str) -> dict:
    env = dict(os.environ, TIERSTORE_CRC32C=impl)
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_faster_implementation_is_chosen_and_agrees_with_the_reference_everywhere():
    assert checksum.IMPLEMENTATION == "fastcrc"
    rng = __import__("random").Random(7)
    m = mmap.mmap(-1, 3 << 20)
    m.write(rng.randbytes(3 << 20))
    mv = memoryview(m)
    for start, n in [(0, 0), (0, 1), (3, 4093), (1, (1 << 20) + 17), (4096, 2 << 20), (5, (3 << 20) - 5)]:
        part = mv[start:start + n]
        assert checksum.crc32c(part) == reference.crc32c(part), (start, n)
        cut = n // 3
        assert checksum.crc32c(part[cut:], checksum.crc32c(part[:cut])) == reference.crc32c(part)
    blocks = checksum.block_checksums(m, (2 << 20) + 9)
    assert blocks == [reference.crc32c(mv[0:1 << 20]), reference.crc32c(mv[1 << 20:2 << 20]),
                      reference.crc32c(mv[2 << 20:(2 << 20) + 9])]
    del part, mv
    m.close()


@pytest.mark.parametrize("impl", _IMPLS)
def test_an_implementation_can_be_named_and_a_wrong_name_is_refused(impl):
    code = ("import json, tierstore.checksum as c; "
            "print(json.dumps({'impl': c.IMPLEMENTATION, 'v': c.crc32c(b'x' * 999)}))")
    assert _run(impl, code) == {"impl": impl, "v": reference.crc32c(b"x" * 999)}
    r = subprocess.run([sys.executable, "-c", "import tierstore.checksum"], capture_output=True, text=True,
                       env=dict(os.environ, TIERSTORE_CRC32C="adler"), timeout=120)
    assert r.returncode != 0 and "TIERSTORE_CRC32C='adler'" in r.stderr


_WRITE = """
import json, sys, torch
from tierstore import Config, Store
s = Store(Config(host_bytes="8MiB", nvme_bytes="64MiB", nvme_dirs=[sys.argv[1]], io_chunk_bytes="1MiB",
                 nvme_grow_bytes="16MiB"))
g = torch.Generator().manual_seed(3)
for i in range(4):
    s.put(torch.randn((i + 1) * 700_000, generator=g), key=f"k{i}", tier="nvme", durable=True)
s.close()
print(json.dumps({}))
"""

_READ = """
import json, os, sys, torch
from tierstore import ChecksumMismatch, Config, Store
s = Store(Config(host_bytes="8MiB", nvme_bytes="64MiB", nvme_dirs=[sys.argv[1]], io_chunk_bytes="1MiB",
                 nvme_grow_bytes="16MiB"))
g = torch.Generator().manual_seed(3)
same = [torch.equal(s.get(s.lookup(f"k{i}")), torch.randn((i + 1) * 700_000, generator=g)) for i in range(4)]
h = s.lookup("k3")
ext = s.index.objects[h.id].nvme[0]
path = s.nvme.drives[ext.dev].path
with open(path, "r+b") as f:  # one bit of the object's third MiB
    f.seek(ext.file_offset + (2 << 20) + 4321)
    b = f.read(1)
    f.seek(ext.file_offset + (2 << 20) + 4321)
    f.write(bytes([b[0] ^ 0x10]))
try:
    s.get(h)
    caught = ""
except ChecksumMismatch as e:
    caught = str(e)
s.close()
print(json.dumps({"same": same, "caught": caught}))
"""


@pytest.mark.parametrize("writer,reader", [("fastcrc", "crc32c"), ("crc32c", "fastcrc")])
def test_a_store_written_under_one_implementation_reads_back_and_catches_a_flip_under_the_other(
        tmp_path, writer, reader):
    d = str(tmp_path / "nvme")
    _run(writer, _WRITE, d)
    out = _run(reader, _READ, d)
    assert out["same"] == [True] * 4
    assert "block 2" in out["caught"]
