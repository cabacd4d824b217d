"""Context parallelism: each CP rank holds part of every sequence; attention runs as a ring over the CP group.

* :func:`context_parallel` (:mod:`~vemesh.parallel.context.api`): torch's context manager for any model that calls SDPA;
  :func:`current_positions`, the global positions of this rank's share inside it;
* :func:`ring_attention`, :func:`shard_sequence`, :func:`positions` (:mod:`~vemesh.parallel.context.ring`): the kernel
  and the cutting it expects, on torch's ring attention; :func:`check_sequence_split`, the one rule for which lengths
  CP can cut.
"""

from vemesh.parallel.context.api import context_parallel, current_positions, sharded_buffers
from vemesh.parallel.context.ring import check_sequence_split, check_torch_api, positions, ring_attention, shard_sequence

__all__ = ["check_sequence_split", "check_torch_api", "context_parallel", "current_positions", "positions", "ring_attention", "shard_sequence",
           "sharded_buffers"]
