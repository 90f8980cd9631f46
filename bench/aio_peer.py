"""DeepSpeed's aio as a benchmark peer, in a process of its own.

Run as a script under an interpreter where ``deepspeed`` imports (``--deepspeed-python``;
the benchmark starts it, nobody needs to by hand):

    python bench/aio_peer.py BLOCK_BYTES QUEUE_DEPTH THREADS MAX_BYTES

it builds (or loads) ``AsyncIOBuilder``, opens one ``aio_handle(BLOCK_BYTES,
QUEUE_DEPTH, single_submit=False, overlap_events=True, THREADS)``, allocates one
page-locked buffer of MAX_BYTES filled with random bytes, prints one JSON line
``{"ready": ...}`` and then answers each line of its standard input with one JSON line
(each prefixed with ``MARK``: DeepSpeed prints lines of its own):

    w N OFF PATH   sync_pwrite of the buffer's first N bytes to PATH at byte OFF (O_DIRECT;
                   created, or overwritten in place as ZeRO-Infinity's swapper overwrites its
                   swap files; no fsync, as DeepSpeed does none) -> {"s": seconds}
    r N OFF PATH   sync_pread of N bytes of PATH from byte OFF into the buffer -> {"s": seconds}

and exits at end of input. ``AioPeer`` is the benchmark's side of it. tierstore never
imports DeepSpeed; this file imports neither.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


MARK = "@aio_peer "
"""Prefix of the peer's replies: DeepSpeed prints lines of its own on standard output."""


def _reply(obj: dict) -> None:
    print(MARK + json.dumps(obj), flush=True)


def _answer(proc: subprocess.Popen) -> dict:
    """The peer's next reply, skipping anything else it printed; {} once it has exited."""
    for line in proc.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return {}


def serve(block: int, depth: int, threads: int, max_bytes: int) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    import deepspeed

    aio = AsyncIOBuilder().load(verbose=False)
    h = aio.aio_handle(block, depth, False, True, threads)
    buf = h.new_cpu_locked_tensor(max_bytes, torch.empty(0, dtype=torch.uint8))
    buf.copy_(torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    _reply({"ready": True, "deepspeed": deepspeed.__version__})
    for line in sys.stdin:
        op, n, off, path = line.split(maxsplit=3)
        view = buf[:int(n)]
        try:
            t0 = time.perf_counter()
            rc = (h.sync_pwrite if op == "w" else h.sync_pread)(view, path.strip(), int(off))
            dt = time.perf_counter() - t0
            _reply({"s": dt} if rc >= 0 else {"error": f"{op} returned {rc}"})
        except Exception as e:  # one failed request is reported, the peer goes on
            _reply({"error": f"{type(e).__name__}: {e}"})
    h.free_cpu_locked_tensor(buf)


class AioPeer:
    """A running ``aio_peer.py`` process: ``write(n, path)`` / ``read(n, path)`` return
    seconds. ``AioPeer.start`` returns a reason string instead where DeepSpeed does not
    import or its aio op does not load under ``python``."""

    def __init__(self, proc: subprocess.Popen, label: str, version: str) -> None:
        self.proc, self.label, self.version = proc, label, version

    @classmethod
    def start(cls, python: str, block: int, depth: int, threads: int, max_bytes: int,
              timeout_s: float = 1800) -> "AioPeer | str":
        label = f"DeepSpeed aio {block >> 20}MiB x qd{depth} x {threads}t"
        try:
            proc = subprocess.Popen([python, os.path.abspath(__file__), str(block), str(depth), str(threads),
                                     str(max_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "DS_ACCELERATOR": "cpu"})
        except OSError as e:
            return f"{python}: {e}"
        ready = _answer(proc)  # (the first load JIT-builds the op: minutes)
        if not ready.get("ready"):
            proc.kill()
            err = proc.communicate(timeout=timeout_s)[1].strip().splitlines()
            return f"DeepSpeed aio unusable under {python}: {err[-1] if err else 'no output'}"
        return cls(proc, label, ready["deepspeed"])

    def _ask(self, op: str, n: int, path: str, offset: int) -> float:
        self.proc.stdin.write(f"{op} {n} {offset} {path}\n")
        self.proc.stdin.flush()
        r = _answer(self.proc) or {"error": "the peer exited"}
        if "error" in r:
            raise RuntimeError(f"{self.label}: {r['error']}")
        return float(r["s"])

    def write(self, n: int, path: str, offset: int = 0) -> float:
        return self._ask("w", n, path, offset)

    def read(self, n: int, path: str, offset: int = 0) -> float:
        return self._ask("r", n, path, offset)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    serve(*(int(a) for a in sys.argv[1:5]))
