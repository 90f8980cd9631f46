"""Cost of choosing an eviction victim under the `trace` policy, against a full sort.

Each client (rank) of a node daemon has its own learned trace; every eviction asks the
policy for its best victim while holding the store's lock. This measures, for one
and several traces of N resident objects, the time per eviction (first candidate,
then the victim's removal and a new object's insertion, as the store does) with the
policy's lazy walk, and with sorting every resident object by the same key (what a
straightforward implementation does per eviction).

Usage: python bench/eviction.py [--objects 1000] [--traces 1,8] [--quick]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json, machine, print_table  # noqa: E402

from tierstore.policy import TracePolicy  # noqa: E402
from tierstore.trace import TraceBook  # noqa: E402


def build(n_traces: int, per_trace: int) -> TracePolicy:
    """``n_traces`` learned traces of ``per_trace`` objects, all resident, cursors mid-step."""
    book = TraceBook()
    pol = TracePolicy(book, {}, lambda trace: 16)  # the prefetcher reaching 16 accesses ahead
    first = 0
    for r in range(n_traces):
        t = book.get(f"rank{r}", "default")
        seq = list(range(first, first + per_trace))
        first += per_trace
        for _ in range(2):
            for oid in seq:
                t.record(oid)
            t.step()
        for oid in seq[:per_trace // 2]:
            t.record(oid)
    for oid in range(first):
        pol.insert(oid)
    return pol


def per_eviction(pol: TracePolicy, pick, rounds: int) -> float:
    pick(pol)  # builds the policy's bookkeeping once, as the first eviction does
    t0 = time.perf_counter()
    for _ in range(rounds):
        victim = pick(pol)
        pol.remove(victim)
        pol.insert(victim)
    return (time.perf_counter() - t0) / rounds


def walk(pol: TracePolicy) -> int:
    return next(iter(pol.candidates()))


def full_sort(pol: TracePolicy) -> int:
    keys = pol.keys()
    return sorted(keys, key=keys.__getitem__)[0]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objects", type=int, default=1000, help="resident objects per trace")
    p.add_argument("--traces", default="1,8", help="trace counts to measure")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.objects, args.traces = 50, "1,2"
    rows, results = [], []
    for n in (int(x) for x in args.traces.split(",")):
        fast = per_eviction(build(n, args.objects), walk, 200)
        slow = per_eviction(build(n, args.objects), full_sort, 5 if not args.quick else 2)
        results.append({"traces": n, "objects_per_trace": args.objects, "walk_ms": fast * 1e3,
                        "sort_ms": slow * 1e3, "speedup": slow / fast})
        rows.append([str(n), str(args.objects), f"{fast * 1e3:.3f}", f"{slow * 1e3:.2f}", f"{slow / fast:.0f}x"])
    print(f"# eviction victim choice, trace policy, every object resident; {machine()}")
    print_table(["traces", "objects/trace", "walk ms", "full sort ms", "speedup"], rows)
    out = {"bench": "eviction", "machine": machine(), "results": results}
    emit_json(out)
    return out


if __name__ == "__main__":
    main()
