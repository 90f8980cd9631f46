"""``tierstore demo``: train a small GPT-style character model with its AdamW state (and fp32
master weights) offloaded to the node daemon's NVMe tier.

The corpus is generated (arithmetic sentences such as "17 plus 25 is 42."), so the
job needs no download; the loss falls visibly within a few hundred steps on two CPU
cores. A daemon is started in the background if none is running.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

import torch
from torch import nn

from tierstore.config import ArgumentParser
from tierstore.errors import TierstoreError
from tierstore.units import format_size

from ..client import Client
from ..torch import offload_optimizer

__all__ = ["main", "TinyGPT", "make_corpus"]


_LR = 3e-3
_WARMUP = 20


def _positive(text: str) -> int:
    """``--steps N``: a whole number of steps, at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n

def make_corpus(n_sentences: int = 20000, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op, val = rng.choice([("plus", a + b), ("minus", a - b), ("times", a * b)])
        out.append(f"{a} {op} {b} is {val}.")
    return " ".join(out)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int = 128, layers: int = 2, heads: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        for emb in (self.tok, self.pos):  # GPT-2's scale: the tied head starts near uniform (loss ~ log vocab)
            nn.init.normal_(emb.weight, std=0.02)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def _bar(frac: float, width: int = 24) -> str:
    n = int(frac * width)
    return "#" * n + "." * (width - n)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="tierstore demo", description=(
        "Train a small GPT-style character model with its AdamW state (and fp32 master weights) offloaded to "
        "the node daemon's NVMe tier. The corpus is generated (arithmetic sentences such as '17 plus 25 is 42.'), "
        "so the job needs no download; the loss falls visibly within a few hundred steps on two CPU cores. A "
        "daemon is started in the background if none is running (log: ~/.cache/tierstore/daemon.log); it keeps "
        "running afterwards (tierstore stat shows its pid; kill PID stops it gracefully)."))
    p.add_argument("--socket", metavar="PATH", help="daemon socket (default: $TIERSTORE_SOCKET or the standard path)")
    p.add_argument("--namespace", default="demo/rank0", metavar="NS",
                   help="namespace holding the optimizer state (default: demo/rank0)")
    p.add_argument("--steps", type=_positive, default=300, metavar="N", help="train until step N (default: 300)")
    p.add_argument("--batch", type=int, default=16, metavar="N", help="sequences per step (default: 16)")
    p.add_argument("--ctx", type=int, default=64, metavar="N", help="context length in characters (default: 64)")
    p.add_argument("--tier", default="nvme", choices=["host", "nvme"],
                   help="tier for the optimizer state (default: nvme)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the state kept in the daemon (refused when it has none, e.g. after the "
                        "daemon restarted: the demo's state is volatile)")
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus, the model and the batches (default: 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _train(args)
    except TierstoreError as e:
        print(f"tierstore demo: {e.code}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


def _train(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    text = make_corpus(seed=args.seed)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    model = TinyGPT(len(chars), ctx=args.ctx)
    n_params = sum(p.numel() for p in model.parameters())
    with Client.connect(socket=args.socket, namespace=args.namespace, autostart=True) as c:
        opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=0.01), c,
                                tier=args.tier, prefix="demo-opt", master_weights=True, resume=args.resume)
        start = opt.completed_steps
        if args.resume and start == 0:
            print(f"tierstore demo: nothing to resume in namespace {args.namespace!r}: the daemon holds no demo "
                  "state there (it was restarted since, and the demo's state is volatile, or no demo ran); "
                  "run without --resume to start from step 0", file=sys.stderr)
            return 1
        print(f"tierstore demo: {n_params:,} parameters, AdamW state + fp32 masters on the {args.tier} tier of "
              f"the daemon (namespace {args.namespace!r}); corpus {len(text):,} characters; "
              f"steps {start}..{args.steps}", flush=True)
        tty = sys.stdout.isatty()
        t_last, ema = time.perf_counter(), None
        for step in range(start, args.steps):
            g = torch.Generator().manual_seed(args.seed * 100003 + step)
            ix = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), generator=g)
            x = torch.stack([data[i:i + args.ctx] for i in ix])
            y = torch.stack([data[i + 1:i + args.ctx + 1] for i in ix])
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            for group in opt.param_groups:  # a short warm-up; it depends on the step only, so resume follows it
                group["lr"] = _LR * min(1.0, (step + 1) / _WARMUP)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            now = time.perf_counter()
            dt, t_last = now - t_last, now
            ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
            if tty or (step + 1) % 25 == 0 or step + 1 == args.steps:
                st = c.stat()["tiers"]
                line = (f"[{_bar((step + 1) / args.steps)}] step {step + 1}/{args.steps}  {dt * 1e3:6.1f} ms  "
                        f"{args.batch * args.ctx / dt:8.0f} tok/s  loss {ema:.3f}  "
                        f"host {format_size(st['host']['used_bytes'])}  nvme {format_size(st['nvme']['used_bytes'])}")
                print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)
        if tty:
            print()
        final = ema if ema is not None else float("nan")
        print(f"done: {opt.completed_steps} steps, loss {final:.3f} (uniform would be {math.log(len(chars)):.3f})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
