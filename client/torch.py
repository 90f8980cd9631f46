"""PyTorch hooks: optimizer-state offload and parameter offload into a tierstore pool.

``offload_optimizer`` wraps a ``torch.optim`` optimizer so its per-parameter state
(and fp32 master weights) lives in the store (the ``optimizer`` package: its update
loop, buckets, progress records and GPU path in modules of their own); ``offload_parameters`` keeps a module's parameters in the store
and brings each submodule's in just before it runs (``params``);
``offload_activations`` keeps the tensors autograd saves for backward in the store
between forward and backward (``activations``); ``dcp_save`` / ``dcp_load`` stream an
offloaded optimizer's state between the pool and a distributed checkpoint (``dcp``). All are written against
``tierstore.contract.Pool``, so a daemon ``Client`` and an in-process ``tierstore.Store``
both work.
"""

from __future__ import annotations

from .activations import ActivationOffload, ActivationStats, offload_activations
from .optimizer import DEFAULT_BUCKET_BYTES, OffloadedOptimizer, TornState, offload_optimizer, offloaded
from .params import offload_parameters

__all__ = ["ActivationOffload", "ActivationStats", "offload_activations", "OffloadedOptimizer", "offload_optimizer", "offloaded", "offload_parameters", "DEFAULT_BUCKET_BYTES",
           "TornState", "dcp_save", "dcp_load"]


def __getattr__(name: str):
    if name in ("dcp_save", "dcp_load"):  # loads torch.distributed.checkpoint: only when asked for
        from . import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
