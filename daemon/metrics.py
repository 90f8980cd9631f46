"""Prometheus metrics for the daemon, read at scrape time from the same counters as
``stat()`` (so ``tierstore stat --json`` and the metrics never disagree)."""

from __future__ import annotations

import logging
from bisect import bisect_left
from typing import Any, Callable, Iterator

__all__ = ["LatencyHistogram", "serve_metrics", "BUCKETS_S"]

log = logging.getLogger(__name__)

BUCKETS_S = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5,
             5.0, 10.0)


class LatencyHistogram:
    """Per-op request counts and latency buckets (cumulative at read time)."""

    def __init__(self) -> None:
        self.ops: dict[str, list[float]] = {}  # op -> [count per bucket..., +Inf count, sum]

    def observe(self, op: str, seconds: float) -> None:
        row = self.ops.get(op)
        if row is None:
            row = self.ops[op] = [0.0] * (len(BUCKETS_S) + 2)
        row[bisect_left(BUCKETS_S, seconds)] += 1  # the first bucket with seconds <= its bound, else +Inf
        row[-1] += seconds

    def snapshot(self) -> dict[str, dict[str, Any]]:
        out = {}
        for op, row in self.ops.items():
            cum, acc = [], 0.0
            for c in row[:-1]:
                acc += c
                cum.append(acc)
            out[op] = {"count": int(acc), "sum_s": row[-1], "buckets": list(zip([*BUCKETS_S, float("inf")], cum))}
        return out


def _collector(stat: Callable[[], dict[str, Any]]) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class Collector:
        def collect(self) -> Iterator[Any]:
            st = stat()
            g = GaugeMetricFamily
            cap = g("tierstore_tier_capacity_bytes", "Tier capacity", labels=["tier"])
            used = g("tierstore_tier_used_bytes", "Tier bytes in use", labels=["tier"])
            objs = g("tierstore_tier_objects", "Objects resident in the tier", labels=["tier"])
            fenced = g("tierstore_tier_fenced_bytes",
                       "Freed bytes held back while a revoked lease's holder is connected", labels=["tier"])
            for tier, t in st["tiers"].items():
                cap.add_metric([tier], t["capacity_bytes"])
                used.add_metric([tier], t["used_bytes"])
                objs.add_metric([tier], t["objects"])
                if "fenced_bytes" in t:
                    fenced.add_metric([tier], t["fenced_bytes"])
            yield from (cap, used, objs, fenced)
            nv = st["tiers"]["nvme"]
            rd = CounterMetricFamily("tierstore_nvme_read_bytes", "Bytes read from the NVMe tier", labels=["engine"])
            rd.add_metric([nv["engine"]], nv["bytes_read"])
            wr = CounterMetricFamily("tierstore_nvme_written_bytes", "Bytes written to the NVMe tier",
                                     labels=["engine"])
            wr.add_metric([nv["engine"]], nv["bytes_written"])
            yield from (rd, wr)
            c = st["counters"]
            for name, help_ in (("put_bytes", "Bytes put"), ("get_bytes", "Bytes got"),
                                ("demoted_bytes", "Bytes demoted host to NVMe"),
                                ("promoted_bytes", "Bytes promoted NVMe to host"),
                                ("leases_revoked", "Leases revoked after lease_timeout_s")):
                m = CounterMetricFamily(f"tierstore_{name}", help_)
                m.add_metric([], c[name])
                yield m
            p = st["prefetch"]
            for name in ("hits", "late", "misses"):
                m = CounterMetricFamily(f"tierstore_prefetch_{name}", f"Accesses that were prefetch {name}")
                m.add_metric([], p[name])
                yield m
            for name, key in (("tierstore_prefetch_stall_seconds", "stall_s"),
                              ("tierstore_prefetch_late_wait_seconds", "late_wait_s"),
                              ("tierstore_prefetched_bytes", "prefetched_bytes"),
                              ("tierstore_prefetch_wasted_bytes", "wasted_bytes")):
                m = CounterMetricFamily(name, key)
                m.add_metric([], p[key])
                yield m
            a = st.get("activations", {})
            for name, key, help_ in (
                    ("tierstore_activation_bytes_in_flight", "bytes_in_flight",
                     "Activation bytes in the pool (saved in forward, not yet freed by backward)"),
                    ("tierstore_activation_held_bytes", "held_bytes",
                     "Activation bytes clients hold in memory for offload (awaiting a put, or fetched back)"),
                    ("tierstore_activation_backward_stall_seconds", "backward_stall_s",
                     "Time backward waited for offloaded activations"),
                    ("tierstore_activation_forward_stall_seconds", "forward_stall_s",
                     "Time forward waited for activation puts"),
                    ("tierstore_activation_offloaded_bytes", "offloaded_bytes", "Activation bytes put"),
                    ("tierstore_activation_fetched_bytes", "fetched_bytes", "Activation bytes fetched back")):
                # sums over the connected clients that report: gauges (a client that goes takes its share)
                m = g(name, help_ + "; summed over connected clients")
                m.add_metric([], a.get(key, 0))
                yield m
            for name, val, help_ in (("tierstore_clients", st.get("clients", 0), "Connected clients"),
                                     ("tierstore_leases", st["leases"], "Leases held"),
                                     ("tierstore_uptime_seconds", st["uptime_s"], "Daemon uptime")):
                m = g(name, help_)
                m.add_metric([], val)
                yield m
            err = CounterMetricFamily("tierstore_errors", "Error replies by code", labels=["code"])
            for code, n in st.get("errors", {}).items():
                err.add_metric([code], n)
            yield err
            ops = CounterMetricFamily("tierstore_requests", "Requests by op", labels=["op"])
            hist = HistogramMetricFamily("tierstore_request_seconds", "Request latency by op", labels=["op"])
            for op, h in st.get("ops", {}).items():
                ops.add_metric([op], h["count"])
                hist.add_metric([op], [(str(b) if b != float("inf") else "+Inf", n) for b, n in h["buckets"]],
                                h["sum_s"])
            yield from (ops, hist)

    return Collector()


def serve_metrics(stat: Callable[[], dict[str, Any]], port: int, addr: str) -> tuple[Any, int]:
    """Start the HTTP endpoint on ``addr:port`` (port 0: any free port); returns (server, port)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(_collector(stat))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    bound = server.server_port
    log.info("Prometheus metrics on http://%s:%d/metrics", addr, bound)
    return server, bound
