"""The checks bench/gpu_check.sh runs before the tests and benchmarks, one subcommand each:

- ``layout REPO SITE``: copy the packages into SITE as pyproject's ``package-dir`` maps
  them (``daemon/`` -> ``tierstore/daemon``): the installed layout, for a dry run where no
  build backend is at hand offline.
- ``check REPO``: the tierstore that imports (and the one ``python -m tierstore.daemon``
  runs) is the installed package, not the source folder of REPO.
- ``env DIR``: GPU, driver, torch, the GPU tier's backend, KvikIO and GPUDirect Storage,
  O_DIRECT in DIR, RLIMIT_MEMLOCK.
- ``smoke DIR``: one real daemon (with a GPU tier where CUDA works), a put and a get.

Each prints what it found and ends with one JSON line (also appended to the partial
results, see bench/common.py). Exit status 1 when the check fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json  # noqa: E402


def layout(repo: str, site: str) -> dict:
    import tomllib

    with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
        st = tomllib.load(f)["tool"]["setuptools"]
    dirs = st.get("package-dir", {})
    data = st.get("package-data", {})
    copied = []
    for pkg in st["packages"]:
        src = os.path.join(repo, dirs.get(pkg, pkg.replace(".", "/")))
        dst = os.path.join(site, *pkg.split("."))
        os.makedirs(dst, exist_ok=True)
        for name in sorted(os.listdir(src)):
            if name.endswith(".py") or name in data.get(pkg, []):
                shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
                copied.append(f"{pkg}:{name}")
    print(f"# copied {len(copied)} file(s) of {len(st['packages'])} packages into {site} (package-dir layout)")
    return {"probe": "layout", "ok": True, "files": len(copied)}


def check(repo: str) -> dict:
    import subprocess

    import tierstore
    import tierstore.client
    import tierstore.daemon

    root = os.path.realpath(repo) + os.sep
    where = {m.__name__: os.path.realpath(m.__file__) for m in (tierstore, tierstore.client, tierstore.daemon)}
    shadowed = {k: v for k, v in where.items() if v.startswith(root)}
    for k, v in where.items():
        print(f"{k:18s} {v}")
    # what a test fixture or a benchmark starts: the daemon module, from this working directory
    r = subprocess.run([sys.executable, "-c", "import tierstore.daemon, os; print(os.path.realpath("
                        "tierstore.daemon.__file__))"], capture_output=True, text=True, timeout=60)
    daemon_at = r.stdout.strip() if r.returncode == 0 else f"import failed: {r.stderr.strip()[-300:]}"
    print(f"python -m tierstore.daemon would run {daemon_at}")
    ok = not shadowed and r.returncode == 0 and not daemon_at.startswith(root)
    if not ok:
        print(f"# the source folder of {repo} shadows the installed package: run from another directory")
    return {"probe": "check", "ok": ok, "where": where, "daemon": daemon_at, "cwd": os.getcwd()}


def env(directory: str) -> dict:
    import resource

    import torch

    from tierstore.engine import probe_direct_io
    from tierstore.engine.kvikio_engine import detect, device_io
    from tierstore.gpu import detect_backend

    os.makedirs(directory, exist_ok=True)
    res: dict = {"probe": "env", "ok": True, "python": sys.version.split()[0], "torch": torch.__version__,
                 "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if res["cuda_available"]:
        res["devices"] = [{"name": torch.cuda.get_device_name(i),
                           "uuid": str(torch.cuda.get_device_properties(i).uuid)}
                          for i in range(torch.cuda.device_count())]
    res["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    res["kvikio"] = detect()[1]
    res["device_io"] = device_io()[1]
    res["gpu_tier"] = detect_backend()[1]
    res["o_direct"] = probe_direct_io(directory)[1]
    res["memlock"] = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    res["nvidia_fs"] = os.path.exists("/proc/driver/nvidia-fs/stats")  # the GDS kernel module
    res["cufile_json"] = os.environ.get("CUFILE_ENV_PATH_JSON") or \
        ("/etc/cufile.json" if os.path.exists("/etc/cufile.json") else None)
    for k, v in res.items():
        print(f"{k:22s} {v}")
    return res


def smoke(directory: str) -> dict:
    import numpy as np
    import torch

    from common import start_daemon
    from tierstore.client import Client

    base = tempfile.mkdtemp(prefix="smoke-", dir=directory)
    cuda = torch.cuda.is_available()
    flags = ["--host-bytes", "64MiB", "--nvme-bytes", "256MiB"] + (["--gpu-bytes", "64MiB"] if cuda else [])
    d, sock, ns = start_daemon(base, *flags, timeout_s=45)
    res: dict = {"probe": "smoke", "cuda": cuda}
    try:
        with Client.connect(socket=sock, namespace="smoke") as c:
            x = torch.arange(1 << 16, dtype=torch.float32, device="cuda" if cuda else "cpu")
            h = c.put(x)
            out = torch.empty_like(x)
            c.get(h, out=out)
            res["host_tier_round_trip"] = bool(torch.equal(out, x))
            st = c.stat()
            res["engine"] = f"{st['tiers']['nvme']['engine']}: {st['tiers']['nvme']['engine_reason']}"
            res["gpu_reason"] = st.get("gpu_reason")
            if cuda and "gpu" in st["tiers"]:
                g = c.put(x, tier="gpu")
                out.zero_()
                c.get(g, out=out)
                res["gpu_tier_round_trip"] = bool(torch.equal(out, x))
            res["pinned"] = c.pinned_reason
            np.testing.assert_array_equal(c.get(h).cpu().numpy(), x.cpu().numpy())
    finally:
        d.terminate()
        d.wait(timeout=30)
        ns.close()
        shutil.rmtree(base, ignore_errors=True)
    res["ok"] = res["host_tier_round_trip"] and res.get("gpu_tier_round_trip", True)
    for k, v in res.items():
        print(f"{k:22s} {v}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("layout")
    lp.add_argument("repo")
    lp.add_argument("site")
    sub.add_parser("check").add_argument("repo")
    sub.add_parser("env").add_argument("dir")
    sub.add_parser("smoke").add_argument("dir")
    a = p.parse_args(argv)
    if a.cmd == "layout":
        res = layout(a.repo, a.site)
    elif a.cmd == "check":
        res = check(a.repo)
    elif a.cmd == "env":
        res = env(a.dir)
    else:
        res = smoke(a.dir)
    emit_json(res)
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
