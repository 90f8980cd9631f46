import os
import shutil
import subprocess
import sys

import pytest

from tierstore import Config, Store


def pytest_collection_modifyitems(config, items):
    import importlib.util

    cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        cuda = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip)


@pytest.fixture
def nvme_dir(tmp_path):
    d = tmp_path / "nvme"
    d.mkdir()
    return str(d)


@pytest.fixture
def make_store(nvme_dir):
    """Open stores over one NVMe directory; each is closed at teardown."""
    opened = []

    def make(**kw):
        kw.setdefault("host_bytes", "32MiB")
        kw.setdefault("nvme_bytes", "512MiB")
        kw.setdefault("nvme_dirs", [nvme_dir])
        kw.setdefault("io_chunk_bytes", "1MiB")
        s = Store(Config(**kw))
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs mount the test owns; skipped where mounting is not permitted."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.decode().strip()}")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def run_py(code: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, **kw)
