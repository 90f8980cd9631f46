"""Optimizer-state offload: a ``torch.optim`` optimizer whose per-parameter state (and
fp32 master weights) lives in a tierstore pool. ``tierstore.client.torch`` re-exports
what users call.

One job per module, composed by the front (``offloaded``):

- ``offloaded``: ``OffloadedOptimizer`` and ``offload_optimizer`` / ``offloaded``: the
  step (which parameters, its end), resume/rewind and the state-dict entry points;
- ``state``: the state's objects in the pool (keys, versions, handles, check-outs);
- ``progress``: the progress records and the torn-step marker; resume and rewind;
- ``buckets``: which small parameters are updated together;
- ``update``: the update loop (one parameter, a bucket, or on the GPU through ``gpu``);
- ``state_dict``: ``optimizer.state`` and the ``state_dict`` format;
- ``backward``: update in backward.
"""

from __future__ import annotations

from .buckets import DEFAULT_BUCKET_BYTES
from .offloaded import OffloadedOptimizer, offload_optimizer, offloaded
from .progress import TornState

__all__ = ["OffloadedOptimizer", "offload_optimizer", "offloaded", "DEFAULT_BUCKET_BYTES", "TornState"]
