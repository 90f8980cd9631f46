"""Daemon instructions per request, this tree against another commit: a count that does
not move with the machine's load.

On a shared VM the time and CPU of one request swing by 2x from minute to minute, more
than any change to compare. The number of instructions the daemon executes per request
does not: each variant's daemon runs under valgrind's callgrind (every thread counted
on its own), a client sends N requests of one kind, then 3N; the difference over 2N is
the instructions per request, user space only (the kernel's share of a syscall is not
counted, so a change that trades a syscall for a little Python reads worse here than it
is). The event loop's thread (``main``) is the figure to compare; ``all`` adds the other
threads (the group committer's, for durable puts), whose idle wake-ups make it noisier.

The other commit is checked out in a temporary git worktree with its own virtualenv
(seeing this interpreter's packages, the package installed editable without dependencies).

Usage: python bench/instructions.py --against 1c4080b [--ops lookup,get,checkout,put,dput] [--n 500]
Needs valgrind (``apt-get install valgrind``) and git.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

OPS = ("lookup", "get", "checkout", "put", "dput")

DRIVER = r"""
import glob, os, signal, socket, subprocess, sys, tempfile, shutil
op, n = sys.argv[1], int(sys.argv[2])
base = tempfile.mkdtemp(prefix="tierstore-instr-")
sock, notify = os.path.join(base, "run", "ts.sock"), os.path.join(base, "notify")
ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
ns.bind(notify)
ns.settimeout(600)
out = os.path.join(base, "cg.out")
d = subprocess.Popen(["valgrind", "--tool=callgrind", "--separate-threads=yes", "--callgrind-out-file=" + out,
                      sys.executable, "-m", "tierstore.daemon", "--socket", sock, "--nvme-dir",
                      os.path.join(base, "nvme"), "--host-bytes", "16MiB", "--nvme-bytes", "1GiB",
                      "--log-level", "WARNING"],
                     env={**os.environ, "NOTIFY_SOCKET": notify, "TIERSTORE_NVME_GROW_BYTES": "16MiB"},
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
seen = b""
ns.settimeout(1)
while b"populated in" not in seen:  # (READY=1 of a daemon that waits for its arena; else the later STATUS)
    try:
        seen += ns.recv(4096)
    except TimeoutError:
        if d.poll() is not None:
            sys.exit(f"the daemon under valgrind exited with status {d.returncode} before it was ready")
import torch
from tierstore.client import Client
try:
    c = Client.connect(socket=sock, namespace="x", prefault=False)
except TypeError:  # a client without the option
    c = Client.connect(socket=sock, namespace="x")
x = torch.zeros(1024)
h = c.put(x, key="k")
i = [0]
def checkout():
    with c.checkout(h, "r"):
        pass
def put(durable):
    i[0] += 1
    c.put(x, key=f"p{i[0]}", durable=durable)
fn = {"lookup": lambda: c.lookup("k"), "get": lambda: c.get(h), "checkout": checkout,
      "put": lambda: put(False), "dput": lambda: put(True)}[op]
for _ in range(n):
    fn()
c.close()
d.send_signal(signal.SIGTERM)
d.wait()
def total(path):
    for line in open(path):
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    return 0
files = sorted(glob.glob(out + "-*"))
print(total(files[0]), sum(total(f) for f in files))
shutil.rmtree(base)
"""


def _count(python: str, cwd: str, op: str, n: int) -> tuple[int, int]:
    r = subprocess.run([python, "-c", DRIVER, op, str(n)], cwd=cwd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{op} x {n} in {cwd} failed: {r.stderr[-2000:]}")
    main, every = r.stdout.split()
    return int(main), int(every)


def per_request(python: str, cwd: str, op: str, n: int) -> dict:
    (m1, a1), (m3, a3) = _count(python, cwd, op, n), _count(python, cwd, op, 3 * n)
    return {"main": (m3 - m1) / (2 * n), "all": (a3 - a1) / (2 * n), "runs_main": [m1, m3]}


def _other_tree(rev: str, root: str) -> tuple[str, str]:
    """A worktree of ``rev`` with its own virtualenv: (its python, its directory)."""
    where = tempfile.mkdtemp(prefix="tierstore-against-")
    tree = os.path.join(where, "tree")
    subprocess.run(["git", "-C", root, "worktree", "add", "--detach", "-q", tree, rev], check=True)
    venv = os.path.join(where, "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    py = os.path.join(venv, "bin", "python")
    # the packages this interpreter sees (torch, msgpack, ...: a virtualenv's included), the
    # other tree's own package put first by its editable install
    here = [p for p in sys.path if p.endswith("-packages") and os.path.isdir(p)]
    theirs = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(theirs, "zz-tierstore-against.pth"), "w") as f:
        f.write("\n".join(here) + "\n")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "-e", tree], check=True)
    return py, tree


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="the git revision to compare with")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--n", type=int, default=500, help="requests of the first run (the second sends 3x); the "
                   "daemon's start and stop vary by a few million instructions, so keep it in the hundreds")
    args = p.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    if bad := [o for o in ops if o not in OPS]:
        p.error(f"unknown op(s) {', '.join(bad)}; choose from {', '.join(OPS)}")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    other_py, other = _other_tree(args.against, root)
    try:
        rows = []
        for op in ops:
            before = per_request(other_py, other, op, args.n)
            print(f"# {op}: {args.against} measured", file=sys.stderr, flush=True)
            now = per_request(sys.executable, root, op, args.n)
            rows.append({"op": op, "before": before, "now": now, "main_ratio": now["main"] / before["main"]})
            print(f"# {op}: this tree measured", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", other], check=False)
        shutil.rmtree(os.path.dirname(other), ignore_errors=True)
    print(f"# daemon instructions per request (callgrind), this tree against {args.against}")
    print(f"{'op':10s} {'main before':>12s} {'main now':>10s} {'ratio':>6s} {'all before':>11s} {'all now':>9s}")
    for r in rows:
        print(f"{r['op']:10s} {r['before']['main']:12.0f} {r['now']['main']:10.0f} {r['main_ratio']:6.3f} "
              f"{r['before']['all']:11.0f} {r['now']['all']:9.0f}")
    out = {"bench": "instructions", "against": args.against, "n": args.n, "rows": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
