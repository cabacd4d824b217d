"""``vemesh.optim``: the import path of :mod:`vemesh.parallel.optim` (ZeRO-1, clipping and loss scaling)."""

from vemesh.parallel.optim import (DistributedOptimizer, GradScaler, clip_grad_norm_, get_optimizer_state,
                                   set_optimizer_state, total_norm)

__all__ = ["DistributedOptimizer", "GradScaler", "clip_grad_norm_", "total_norm", "get_optimizer_state",
           "set_optimizer_state"]
