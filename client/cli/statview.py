"""Human rendering of ``stat()`` for ``tierstore stat`` (and its ``--watch`` mode)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

from tierstore.errors import TierstoreError
from tierstore.units import format_size

__all__ = ["render", "print_stat", "shown", "watch"]


def _bar(used: int, cap: int, width: int = 30) -> str:
    frac = used / cap if cap else 0.0
    n = round(frac * width)
    return "[" + "#" * n + "." * (width - n) + f"] {frac * 100:5.1f}%"


def render(st: dict[str, Any], prev: dict[str, Any] | None = None, interval_s: float | None = None) -> str:
    lines = [f"tierstore {st.get('version', '?')}  pid {st.get('pid', '?')}  uptime {st.get('uptime_s', 0):.0f} s  "
             f"clients {st.get('clients', 0)}  leases {st.get('leases', 0)}  policy {st.get('policy', '?')}"]
    tiers = st.get("tiers", {})
    for name in ("gpu", "host", "nvme"):
        t = tiers.get(name)
        if not t:
            continue
        cap, used = t["capacity_bytes"], t["used_bytes"]
        line = (f"  {name:5} {_bar(used, cap)}  used {format_size(used)} / {format_size(cap)}  "
                f"free {format_size(cap - used)}  objects {t['objects']}")
        if t.get("fenced_bytes"):
            line += f"  fenced {format_size(t['fenced_bytes'])} (revoked leases' holders still connected)"
        lines.append(line)
    if "gpu" not in tiers and st.get("gpu_reason"):
        lines.append(f"  gpu   absent ({st['gpu_reason']})")
    h = tiers.get("host", {})
    if h:
        lines.append(f"        host pinned: {h.get('pinned')} ({h.get('pinned_reason', '')})")
        if "huge_pages" in h:
            lines.append(f"        host huge pages: {format_size(h.get('huge_page_bytes', 0))} ({h['huge_pages']})")
    told = [s for s in st.get("sessions", []) if s.get("pinned") is not None]
    if told:
        unpinned = [s for s in told if not s["pinned"]]
        line = f"        clients pinned: {len(told) - len(unpinned)} of {len(told)} that reported"
        if unpinned:
            line += f" (pid {unpinned[0]['pid']}: {unpinned[0]['pinned_reason']})"
        lines.append(line)
    n = tiers.get("nvme", {})
    if n:
        lines.append(f"        engine: {n.get('engine')} ({n.get('engine_reason')})")
        lines.append(f"        O_DIRECT: {n.get('direct_io')} ({n.get('direct_io_reason')})")
        if "checksums" in n:
            lines.append(f"        checksums: CRC32C per 1 MiB block ({n['checksums']})")
        drives = n.get("drives", [])
        if drives:
            line = (f"        data files: {format_size(sum(d.get('file_bytes', 0) for d in drives))} on disk "
                    f"in {len(drives)} file{'s' if len(drives) > 1 else ''}")
            if n.get("trimmed_bytes"):
                line += f", {format_size(n['trimmed_bytes'])} of free tail given back"
            lines.append(line)
        if prev and interval_s:
            pn = prev["tiers"]["nvme"]
            rd = (n["bytes_read"] - pn["bytes_read"]) / interval_s
            wr = (n["bytes_written"] - pn["bytes_written"]) / interval_s
            lines.append(f"        bandwidth: read {format_size(rd)}/s  write {format_size(wr)}/s")
        else:
            lines.append(f"        total: read {format_size(n.get('bytes_read', 0))}  "
                         f"written {format_size(n.get('bytes_written', 0))}")
    p = st.get("prefetch", {})
    total = p.get("hits", 0) + p.get("misses", 0) + p.get("late", 0)
    rate = p.get("hits", 0) / total if total else 0.0
    lines.append(f"  prefetch: hit rate {rate * 100:.1f}%  hits {p.get('hits', 0)}  late {p.get('late', 0)} "
                 f"(waited {p.get('late_wait_s', 0):.3f} s)  misses {p.get('misses', 0)}  stall {p.get('stall_s', 0):.3f} s  "
                 f"prefetched {format_size(p.get('prefetched_bytes', 0))}  wasted {format_size(p.get('wasted_bytes', 0))}")
    for t in p.get("traces", []):
        lines.append(f"    trace client {t['client']} stream {t['stream']}: {t['state']}, {t['length']} accesses/step, "
                     f"{t['steps']} steps, relearned {t['relearned']}x")
    a = st.get("activations", {})
    if a.get("clients"):
        lines.append(f"  activations ({a['clients']} clients): in flight {format_size(a['bytes_in_flight'])} "
                     f"(peak {format_size(a['peak_bytes_in_flight'])})  held {format_size(a['held_bytes'])}  "
                     f"backward stall {a['backward_stall_s']:.3f} s  forward stall {a['forward_stall_s']:.3f} s  "
                     f"put {format_size(a['offloaded_bytes'])}  fetched {format_size(a['fetched_bytes'])}")
    ns = st.get("namespaces", {})
    lines.append(f"  namespaces ({len(ns)}):")
    for name in sorted(ns):
        lines.append(f"    {shown(name):30} objects {ns[name]['objects']:>8}  {format_size(ns[name]['bytes']):>10}")
    j = st.get("journal", {})
    if "checkpoint" in j:
        how = ("from the index checkpoint, then" if j["checkpoint"] == "used" else
               f"replaying the whole journal (index checkpoint {j['checkpoint']}):")
        lines.append(f"  journal {format_size(j.get('bytes', 0))}; started {how} {j.get('records_replayed', 0)} records")
    if "checkpoint_covers_bytes" in j:
        lines.append(f"  index checkpoint covers the journal's first {format_size(j['checkpoint_covers_bytes'])} "
                     f"({j.get('checkpoints_written', 0)} written since the start)")
    if j.get("kept_aside") or j.get("cut_bytes"):
        lines.append(f"  journal recovery at start: {j.get('corrupt_records', 0)} damaged stretches, "
                     f"{j.get('malformed_records', 0)} malformed records, torn tail {j.get('torn_bytes', 0)} B skipped"
                     + (f", {j['cut_bytes']} B cut (recovered from the index checkpoint)" if j.get("cut_bytes") else "")
                     + f"; {j.get('superseded', 0)} objects superseded; journal as found: {j.get('kept_aside')}")
    if st.get("errors"):
        lines.append("  errors: " + ", ".join(f"{k}={v}" for k, v in sorted(st["errors"].items())))
    return "\n".join(lines)


def print_stat(st: dict[str, Any]) -> None:
    print(render(st))


def watch(connect: Callable[[], Any], interval_s: float, *, as_json: bool = False,
          iterations: int | None = None) -> int:
    """Redraw every ``interval_s`` until interrupted (or ``iterations`` frames)."""
    prev = None
    n = 0
    with connect() as c:
        while iterations is None or n < iterations:
            try:
                st = c.stat(ops=as_json)  # (the same document as `stat --json`)
            except TierstoreError as e:
                print(f"tierstore: {e}", file=sys.stderr)
                return 1
            if as_json:
                print(json.dumps(st, default=str), flush=True)
            else:
                if sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")
                print(render(st, prev, interval_s if prev else None), flush=True)
            prev = st
            n += 1
            if iterations is None or n < iterations:
                time.sleep(interval_s)
    return 0


def shown(name: str) -> str:
    """A name as the terminal may print it: escapes for anything not printable (a name
    journaled before such names were refused must not move the cursor or forge a line; a
    key's format characters, such as a right-to-left override or a zero-width space, must
    not disguise it as another)."""
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")
