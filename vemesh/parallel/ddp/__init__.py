"""Data parallelism with a contiguous gradient buffer: :class:`DistributedDataParallel`."""

from vemesh.parallel.ddp.distributed_data_parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
