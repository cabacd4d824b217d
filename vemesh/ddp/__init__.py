"""Data parallelism with a contiguous gradient buffer: :class:`DistributedDataParallel`."""

from .distributed_data_parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
