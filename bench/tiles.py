"""An elementwise optimizer's update of large CPU parameters, whole and a tile at a time.

The offloaded optimizer runs torch's Adam, AdamW, SGD, RMSprop and Adagrad over a large
CPU parameter a tile at a time (``tierstore.client.optimizer.tiles``). This times,
in one process and alternated round by round, the wrapped rule's ``step()`` over each
whole parameter (as the plain optimizer does) and ``step_tiled`` over the same
parameters, each from the same state and gradients, with the page faults and CPU
seconds each takes, beside the ceiling: a ``memcpy`` of the bytes the update must read
and write (AdamW reads the parameter, gradient and two moments and writes three of
them: 7 x 4 bytes per fp32 element). After the timed rounds both ways run once more
from one copy of the state and must give the same bits.

Usage: python bench/tiles.py [--layers 16] [--width 4096] [--rounds 5] [--rule adamw|adam|sgd] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json, machine, print_table  # noqa: E402

RULES = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
         "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4),
         "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)}
TOUCHED = {"adamw": 7, "adam": 7, "sgd": 5}
"""fp32 words read and written per element by one update (parameter, gradient, state)."""


def _measure(fn) -> dict:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {"s": dt, "cpu_s": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
            "faults": r1.ru_minflt - r0.ru_minflt}


def main(argv: list[str] | None = None) -> dict:
    from tierstore.client.optimizer.tiles import TILE_BYTES, step_tiled, tileable

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rule", choices=sorted(RULES), default="adamw")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.rounds = 2, 1024, 2
    torch.manual_seed(0)
    n = args.width * args.width
    params = [torch.nn.Parameter(torch.randn(n)) for _ in range(args.layers)]
    for q in params:
        q.grad = torch.randn(n)
    opt = RULES[args.rule](params)
    opt.step()  # the state exists: every timed step is an update
    group = opt.param_groups[0]
    if not all(tileable(opt, group, q, opt.state[q]) for q in params):
        raise SystemExit(f"parameters of {n * 4} bytes are not tiled (TILE_BYTES {TILE_BYTES})")

    def whole() -> None:
        opt.step()

    def tiled() -> None:
        for q in params:
            opt.state[q] = step_tiled(opt, group, q, opt.state[q])
        opt.param_groups = [group]

    touched = TOUCHED[args.rule] * 4 * n * args.layers
    src, dst = np.ones(touched // 2, np.uint8), np.zeros(touched // 2, np.uint8)

    def memcpy() -> None:  # reads and writes `touched` bytes together
        np.copyto(dst, src)

    variants = {"whole (plain)": whole, "tiles": tiled, "memcpy (ceiling)": memcpy}
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for r in range(args.rounds + 1):
        names = list(variants)
        for k in names[r % len(names):] + names[:r % len(names)]:
            m = _measure(variants[k])
            if r:  # round 0 warms up
                runs[k].append(m)
    # the same bits: both ways from one copy of the state
    saved = copy.deepcopy(opt.state_dict())
    before = [q.detach().clone() for q in params]
    whole()
    after_whole = [q.detach().clone() for q in params]
    for q, b in zip(params, before):
        q.data.copy_(b)
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    tiled()
    same = all(torch.equal(a, q) for a, q in zip(after_whole, params))
    med = {k: {f: statistics.median(m[f] for m in v) for f in ("s", "cpu_s", "faults")} for k, v in runs.items()}
    ceiling = med["memcpy (ceiling)"]["s"]
    rows = [[k, f"{m['s']:.3f}", f"{m['s'] / med['whole (plain)']['s']:.2f}", f"{m['s'] / ceiling:.2f}",
             f"{m['cpu_s']:.2f}", f"{m['faults'] / 1e3:.0f}k"] for k, m in med.items()]
    print(f"# tiles: {args.rule}, {args.layers} parameters of {n} fp32 elements ({n * 4 >> 20} MiB), tiles of "
          f"{TILE_BYTES >> 10} KiB, {args.rounds} rounds (median), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {machine()}")
    print(f"# memcpy copies {touched / 2**30:.2f} GiB read + written, what one update reads and writes")
    print_table(["variant", "s", "vs whole", "vs memcpy", "cpu s", "page faults"], rows)
    print(f"# tiled and whole updates from the same state: {'the same bits' if same else 'DIFFERENT BITS'}")
    out = {"bench": "tiles", "rule": args.rule, "layers": args.layers, "elements": n, "tile_bytes": TILE_BYTES,
           "rounds": args.rounds, "results": med, "same_bits": same, "machine": machine()}
    emit_json(out)
    if not same:
        raise SystemExit("the tiled update differs from the whole one")
    return out


if __name__ == "__main__":
    main()
