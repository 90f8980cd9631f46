"""A small GPT-style model laid out for tensor parallelism, shared by bench/train_dist.py
and the distributed tests: q/k/v and fc1 split by output (heads) under ``ColwiseParallel``,
o and fc2 by input under ``RowwiseParallel``; attention counts its heads from the local
width, so the same module runs whole or split."""

from __future__ import annotations

import torch
from torch import nn

TP_PLAN_NAMES = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise", "fc1": "colwise", "fc2": "rowwise"}


class Block(nn.Module):
    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt(vocab: int, width: int, layers: int, seed: int = 0) -> nn.Sequential:
    """Embedding, ``layers`` blocks, head: one Sequential, so stages are slices of it."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(vocab, width), *[Block(width) for _ in range(layers)], Head(width, vocab))


def tp_plan() -> dict:
    """The tensor-parallel plan of a Block (``parallelize_module(block, mesh, tp_plan())``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {name: ColwiseParallel() if kind == "colwise" else RowwiseParallel() for name, kind in TP_PLAN_NAMES.items()}
