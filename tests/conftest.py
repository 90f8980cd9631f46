import os
import shutil
import subprocess
import sys

import pytest

from tierstore import Config, Store

sys.path.insert(0, os.path.dirname(__file__))  # tests/faults.py is a module of the suite

# The suite starts a few hundred Python processes (daemons, clients, torchrun ranks), most of
# them importing torch. Where the environment forbids writing bytecode caches
# (PYTHONDONTWRITEBYTECODE, common in containers) and the install skipped compiling
# (``pip install --no-compile``), each of them would compile torch's sources again: about
# 3 s of CPU apiece on a small machine. The tests let Python cache what it compiles.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """A short temporary root unless one is given: tests put daemon sockets under their
    tmp_path, an AF_UNIX path holds at most 107 bytes, and pytest-xdist adds a level
    (``popen-gw0``) under pytest's default root (``/tmp/pytest-of-USER/pytest-N``)."""
    import tempfile

    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="ts-")
        config._tierstore_basetemp = config.option.basetemp


def pytest_unconfigure(config):
    root = getattr(config, "_tierstore_basetemp", None)
    if root:  # what passing tests left is gone already (tmp_path_retention_policy); keep failures
        for sub, dirs, _files in os.walk(root, topdown=False):
            for d in dirs:
                try:
                    os.rmdir(os.path.join(sub, d))
                except OSError:
                    pass
        try:
            os.rmdir(root)
        except OSError:
            pass


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
        kw.setdefault("nvme_grow_bytes", "16MiB")  # a small preallocation step: tests stay light on disk
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


def in_threads(fn, n: int) -> list[BaseException]:
    """Run ``fn(k)`` for k in range(n) on n threads; the exceptions they raised."""
    import threading

    errors: list[BaseException] = []

    def run(k):
        try:
            fn(k)
        except BaseException as e:  # surfaced by the caller
            errors.append(e)
    ts = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors


def poll_until(ok, what: str, timeout_s: float = 30.0, every_s: float = 0.01):
    """Call ``ok()`` until it returns something true, and return that; fail naming
    ``what`` after ``timeout_s``. For state another thread or process changes, where no
    event says when: a deadline, never a bare sleep."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        got = ok()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)


def run_py(code: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, **kw)


_NOTIFY_POLL_S = 0.2
"""How often a wait for the daemon's notify message checks that the daemon is still running."""


class DaemonProc:
    """A real daemon process on a socket in tmp_path, ready when it says READY=1."""

    def __init__(self, base, extra_args=(), env=None):
        import socket as _s

        self.base = base
        self.socket = str(base / "run" / "tierstore.sock")
        self.nvme = str(base / "nvme")
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.log = base / "daemon.log"
        self.notify_path = str(base / "notify.sock")
        self.notify = _s.socket(_s.AF_UNIX, _s.SOCK_DGRAM)
        self.notify.bind(self.notify_path)
        self.notify.settimeout(_NOTIFY_POLL_S)
        self.messages: list[str] = []
        self.fdstore: dict[str, int] = {}
        self.proc = None

    def start(self, expect_ready=True):
        env = dict(os.environ)
        env.update({"NOTIFY_SOCKET": self.notify_path, "PYTHONUNBUFFERED": "1",
                    "TIERSTORE_NVME_GROW_BYTES": "16MiB"})
        env.update(self.env)
        args = [sys.executable, "-m", "tierstore.daemon", "--socket", self.socket, "--nvme-dir", self.nvme,
                "--host-bytes", "64MiB", "--nvme-bytes", "1GiB", "--log-level", "DEBUG", *self.extra_args]
        self.logf = open(self.log, "ab")
        self.proc = subprocess.Popen(args, env=env, stdout=self.logf, stderr=self.logf)
        if expect_ready:
            self.wait_for("READY=1")
        return self

    def wait_for(self, needle, timeout_s=60.0):
        """Block until the daemon sends a notify datagram containing ``needle`` (no sleeps).
        A daemon that exits first fails the wait at once, with its exit status and log."""
        import socket as _s
        import time

        deadline = time.monotonic() + timeout_s
        # the process to watch: ours if it runs now (a relaunch by other means is not ours to watch)
        watch = self.proc if self.proc is not None and self.proc.poll() is None else None
        exited = False
        while True:
            if any(needle in m for m in self.messages):
                return [m for m in self.messages if needle in m][0]
            try:
                # short receive timeouts: between them, see whether the process is still there
                raw, fds, _, _ = _s.recv_fds(self.notify, 4096, 8)
            except TimeoutError:
                if watch is not None and watch.poll() is not None:
                    if exited:  # what it sent before it exited has been read
                        raise AssertionError(f"daemon exited with status {watch.returncode} before sending "
                                             f"{needle!r}; log:\n{self.log.read_text()[-3000:]}") from None
                    exited = True
                    continue
                if time.monotonic() > deadline:
                    raise AssertionError(f"daemon never sent {needle!r} in {timeout_s:.0f} s; "
                                         f"log:\n{self.log.read_text()[-3000:]}") from None
                continue
            msg = raw.decode()
            if fds and "FDNAME=" in msg:  # FDSTORE=1: keep the fd, as systemd would
                name = msg.split("FDNAME=")[1].split()[0]
                if name in self.fdstore:
                    os.close(self.fdstore[name])
                self.fdstore[name] = fds[0]
            self.messages.append(msg)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        self.messages.clear()
        return self.proc.returncode

    def kill(self):
        import signal

        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.messages.clear()

    def restart(self):
        self.stop()
        return self.start()

    def client(self, namespace="default", **kw):
        from tierstore.client import Client

        return Client.connect(socket=self.socket, namespace=namespace, **kw)

    def close(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()
        if hasattr(self, "logf"):
            self.logf.close()


@pytest.fixture
def daemon_factory(tmp_path):
    import pathlib
    import tempfile

    made = []
    public_dirs = []

    def make(*extra_args, env=None, start=True, name="d", public=False):
        if public:  # reachable by other uids (tmp_path's parents are 0700)
            base = pathlib.Path(tempfile.mkdtemp(prefix="tierstore-test-", dir="/tmp"))
            base.chmod(0o755)
            public_dirs.append(base)
        else:
            base = tmp_path / f"{name}{len(made)}"
            base.mkdir()
        d = DaemonProc(base, extra_args, env)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.close()
    for p in public_dirs:
        shutil.rmtree(p, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()
