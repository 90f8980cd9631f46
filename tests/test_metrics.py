"""Prometheus metrics scraped over HTTP from a running daemon agree with stat()."""

import urllib.request

import torch


def _scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_match_stat(daemon_factory):
    d = daemon_factory("--metrics-port", "0")
    with d.client("m") as c:
        for i in range(5):
            c.put(torch.randn(1000), key=f"k{i}")
        c.put(torch.randn(100_000), key="disk", tier="nvme")
        c.get(c.lookup("k1"))
        try:
            c.get(10**9)
        except Exception:
            pass
        st = c.stat(ops=True)
        assert st["ops"]["put_staged"]["count"] >= 5
        port = st["metrics_port"]
        assert port and port > 0
        m = _scrape(port)
    assert m['tierstore_tier_capacity_bytes{tier="host"}'] == st["tiers"]["host"]["capacity_bytes"]
    assert m['tierstore_tier_used_bytes{tier="nvme"}'] == st["tiers"]["nvme"]["used_bytes"]
    assert m['tierstore_tier_objects{tier="host"}'] == st["tiers"]["host"]["objects"]
    assert m['tierstore_nvme_written_bytes_total{engine="posix"}'] == st["tiers"]["nvme"]["bytes_written"]
    assert st["errors"]["NotFound"] >= 1
    assert m['tierstore_errors_total{code="NotFound"}'] == st["errors"]["NotFound"]
    assert m['tierstore_requests_total{op="put_staged"}'] >= 5
    assert m['tierstore_request_seconds_count{op="put_staged"}'] == m['tierstore_requests_total{op="put_staged"}']
    assert m["tierstore_clients"] >= 1
    assert m["tierstore_prefetch_hits_total"] == st["prefetch"]["hits"]
    assert m["tierstore_prefetch_late_wait_seconds_total"] == st["prefetch"]["late_wait_s"]


def test_metrics_bind_loopback_by_default(daemon_factory):
    d = daemon_factory("--metrics-port", "0")
    with d.client() as c:
        port = c.stat()["metrics_port"]
    import socket

    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    local = [r[1] for r in rows if int(r[1].split(":")[1], 16) == port and r[3] == "0A"]  # LISTEN
    assert local and all(addr.startswith("0100007F") for addr in local)  # 127.0.0.1
    assert socket.gethostbyname("localhost").startswith("127.")
