"""bench/gpu_check.sh, the device script, on a CPU machine: its dry run installs tierstore
offline, runs everything from outside the repository against the installed package, and
leaves every step's status and result in $OUT; the test fixtures fail at once when a
daemon dies instead of waiting out a readiness timeout."""

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def test_dry_run_installs_and_runs_every_step_from_outside_the_repository(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", os.path.join(REPO, "bench", "gpu_check.sh"), "--dry-run"], env=env,
                       capture_output=True, text=True, timeout=400)
    steps = (out / "steps.txt").read_text()
    assert r.returncode == 0, steps + r.stdout[-3000:] + r.stderr[-2000:]
    for name in ("check-install", "env", "daemon-smoke", "tests", "gpu_transfer", "gpu_nvme", "gpu_train"):
        assert f"{name} rc=0 " in steps, steps
    assert "install-tierstore rc=0" in steps or "install-layout rc=0" in steps, steps
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    [check] = [x for x in results if x.get("probe") == "check"]
    assert check["ok"] and not check["cwd"].startswith(REPO)
    for where in (*check["where"].values(), check["daemon"]):  # the installed package, not the source folder
        assert not where.startswith(REPO + os.sep), where
    assert {x.get("bench") for x in results} >= {"gpu_transfer", "gpu_nvme", "gpu_train"}
    assert [x["ok"] for x in results if x.get("probe") == "smoke"] == [True]
    assert len(os.listdir(out)) <= 8  # what the device hands back: at most 8 files
    work = steps.splitlines()[0].removeprefix("work directory ")
    assert work.startswith("/") and not os.path.exists(work)  # its work directory went with it


def test_the_layout_fallback_maps_package_dirs_as_an_install_does(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_probe.py"), "layout", REPO, str(site)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (site / "tierstore" / "daemon" / "__main__.py").exists()
    assert (site / "tierstore" / "client" / "client.py").exists()
    assert (site / "tierstore" / "daemon" / "tierstore.service").exists()
    r = subprocess.run([sys.executable, "-c", "import tierstore.daemon.__main__ as m, tierstore.client.client as c; "
                        "print(m.__file__); print(c.__file__)"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr
    assert all(line.startswith(str(site)) for line in r.stdout.split()), r.stdout


def test_a_daemon_that_dies_at_start_fails_the_wait_at_once(daemon_factory):
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="daemon exited with status"):
        daemon_factory("--engine", "no-such-engine")
    assert time.monotonic() - t0 < 30  # not the 60 s readiness timeout


def test_gpu_nvme_writes_its_whole_file_when_pwritev_moves_less_per_call(tmp_path, monkeypatch):
    """Linux moves at most 0x7ffff000 bytes per pwritev, so a 2 GiB file takes two calls;
    here every call is capped far lower, and the file still comes out whole."""
    import numpy as np

    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        import gpu_nvme
    finally:
        sys.path.remove(os.path.join(REPO, "bench"))
    real, calls = os.pwritev, []

    def capped(fd, bufs, offset):
        calls.append(offset)
        return real(fd, [memoryview(bufs[0])[:12288]], offset)  # a short write: 3 pages of it
    monkeypatch.setattr(os, "pwritev", capped)
    src = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)
    path = str(tmp_path / "f.bin")
    gpu_nvme.write_source(path, src)
    assert len(calls) == -(-src.nbytes // 12288)
    assert (np.fromfile(path, np.uint8) == src).all()
