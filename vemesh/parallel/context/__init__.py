"""Context parallelism: each CP rank holds part of every sequence; attention runs as a ring over the CP group."""

from vemesh.parallel.context.ring import check_torch_api, positions, ring_attention, shard_sequence

__all__ = ["check_torch_api", "positions", "ring_attention", "shard_sequence"]
