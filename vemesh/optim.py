"""``vemesh.optim``: the import path of :mod:`vemesh.parallel.optim` (ZeRO-1 and clipping)."""

from vemesh.parallel.optim import (DistributedOptimizer, clip_grad_norm_, get_optimizer_state, set_optimizer_state,
                                   total_norm)

__all__ = ["DistributedOptimizer", "clip_grad_norm_", "total_norm", "get_optimizer_state", "set_optimizer_state"]
