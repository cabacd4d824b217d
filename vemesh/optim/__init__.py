"""ZeRO-1 optimizer sharding over the data-parallel group: :class:`DistributedOptimizer`."""

from .distributed_optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
