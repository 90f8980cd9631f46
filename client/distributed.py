"""Agreement between the ranks of a job about the step they resume from. Each rank's
offloaded optimizer keeps its own progress record in its node's daemon; after a failure
the ranks of different nodes may have completed different numbers of steps (a node's
daemon lost while the others finished their optimizer step). This module only compares
and rewinds through ``torch.distributed``; tierstore itself never crosses nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .optimizer import OffloadedOptimizer

__all__ = ["agree_on_step"]


def agree_on_step(optimizer: OffloadedOptimizer, group: Any = None) -> int:
    """The step every rank of ``group`` continues from: the least ``completed_steps`` of
    them; a rank one step ahead goes back to it (``OffloadedOptimizer.rewind_to``).
    Raises ``RuntimeError`` on every rank when the ranks are further apart or one cannot
    go back, so the job can restore a distributed checkpoint instead. Collective: every
    rank of ``group`` calls it."""
    import torch.distributed as dist

    steps: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(steps, optimizer.completed_steps, group=group)
    target = min(steps)
    problem = None
    if max(steps) - target > 1:
        problem = f"ranks completed steps {steps}: more than one step apart"
    else:
        try:
            optimizer.rewind_to(target)
        except ValueError as e:
            problem = str(e)
    problems: list[Any] = [None] * len(steps)
    dist.all_gather_object(problems, problem, group=group)  # every rank fails together, not just the one
    bad = [(r, p) for r, p in enumerate(problems) if p is not None]
    if bad:
        raise RuntimeError(f"the ranks cannot resume at one step (rank {bad[0][0]}: {bad[0][1]}); restore the job "
                           "from its last distributed checkpoint")
    return target
