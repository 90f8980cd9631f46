"""An elementwise update rule run over a large parameter a tile at a time.

``torch.optim.AdamW`` on a 64 MiB CPU parameter makes temporaries of the parameter's
size (``exp_avg_sq.sqrt()``, the denominator, the step), which glibc's allocator maps
fresh and gives back to the kernel every time: on CPU the page faults cost as much as
the arithmetic, and the tensors stream through memory once per operation. The same
rule run over slices of ``TILE_BYTES`` makes temporaries the allocator keeps and
reuses, and works on what is still in the cache: the update of a 269 M-parameter model
took 0.27 s instead of 0.86 s on 2 cores, with no page faults instead of 524 000 (docs/benchmarks.md).

Only where that is the same update, bit for bit: the wrapped optimizer is exactly one of
``ELEMENTWISE`` (not a subclass, which may change the rule), the parameter, its gradient
and every state tensor of the parameter's shape are contiguous fp32 CPU tensors (an
fp32 master of a bf16 or fp16 parameter is; in bf16 and fp16 themselves torch's
vectorised and scalar loops round differently, so where a tile ends changes bits), the
gradient is dense, and nothing asks for a differentiable step.
Every element of such a rule depends only on the same element of its inputs and on the
state that is not of the parameter's shape (the step count), which each tile reads
from a copy of its value before the update, so that every tile updates from the same
step as the whole would; the last tile's copy becomes the state. ``Updates`` calls
``step_tiled`` where ``tileable`` says so, and the wrapped optimizer's ``step()`` once
over the whole parameter otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ELEMENTWISE", "TILE_BYTES", "step_tiled", "tileable"]

ELEMENTWISE: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop,
                                 torch.optim.Adagrad)
"""Rules whose update of each element reads only that element of the parameter, the
gradient and the state (and scalars): tested bit-identical tiled and whole."""

TILE_BYTES = 1 << 20
"""The bytes of the parameter one call updates (256 Ki fp32 elements)."""

_SETTLE_BYTES = 4 * TILE_BYTES
_settled = False


def _settle_allocator() -> None:
    """Free one block of ``_SETTLE_BYTES`` once per process. glibc's malloc maps a block
    at least its threshold (128 KiB at first) afresh and unmaps it when freed, and raises
    the threshold to the largest such block freed so far (at most 32 MiB), keeping the
    heap's free top up to twice it. A process that never freed a block of a tile's size
    (a model whose tensors are all larger than 32 MiB or smaller than 128 KiB) would map,
    fault in and give back every temporary of every tile; after this one block the
    tiles' temporaries come from the heap and stay there. (Other allocators, and a
    glibc whose threshold is already higher, are left as they are.)"""
    global _settled
    if not _settled:
        _settled = True
        torch.empty(_SETTLE_BYTES, dtype=torch.uint8)  # mapped, then freed at once


def _plain_cpu(t: Any) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.is_contiguous() \
        and t.dtype == torch.float32 and t.layout == torch.strided


def tileable(inner: torch.optim.Optimizer, group: dict[str, Any], target: torch.Tensor,
             state: dict[str, Any]) -> bool:
    """Whether ``step_tiled`` updates ``target`` (whose ``grad`` is set) exactly as one
    ``inner.step()`` over it would (see the module docstring)."""
    if type(inner) not in ELEMENTWISE or group.get("differentiable") or target.numel() * target.element_size() \
            <= TILE_BYTES:
        return False
    grad = target.grad
    if grad is None or not _plain_cpu(target) or not _plain_cpu(grad) or grad.shape != target.shape:
        return False
    for v in state.values():
        if isinstance(v, torch.Tensor) and v.shape == target.shape and not _plain_cpu(v):
            return False
    return True


def step_tiled(inner: torch.optim.Optimizer, group: dict[str, Any], target: torch.Tensor,
               state: dict[str, Any]) -> dict[str, Any]:
    """Update ``target`` from ``target.grad`` and ``state`` (its tensors of ``target``'s
    shape written in place) by ``inner.step()`` over one tile at a time; returns the
    state after the update (those tensors, and the rest as the last tile left them).
    ``inner``'s ``param_groups`` and ``state`` are the caller's to restore."""
    _settle_allocator()
    n = target.numel()
    per = max(1, TILE_BYTES // target.element_size())
    flat, grad = target.detach().view(-1), target.grad.view(-1)
    whole = {k: v.view(-1) for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == target.shape}
    rest = {k: v for k, v in state.items() if k not in whole}
    last: dict[str, Any] = rest
    for a in range(0, n, per):
        tile = flat[a:a + per]
        tile.grad = grad[a:a + per]
        inner.state[tile] = {**{k: v[a:a + per] for k, v in whole.items()},
                             **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in rest.items()}}
        inner.param_groups = [dict(group, params=[tile])]
        try:
            inner.step()
        finally:
            last = inner.state.pop(tile, last)
            tile.grad = None
    out = dict(state)
    for k, v in rest.items():
        if isinstance(v, torch.Tensor):
            v.copy_(last[k])
        else:
            out[k] = last[k]
    return out
