"""``vemesh.ddp``: the import path of :mod:`vemesh.parallel.ddp` (data parallelism)."""

from vemesh.parallel.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
