"""Pure arithmetic for the contiguous gradient buffer: where each parameter lives and how
the buffer splits into buckets.

Nothing here touches ``torch.distributed``; it runs (and is tested) without a process group.

A small example: three parameters of 5, 3 and 6 elements, ``bucket_size=8``::

    >>> layout = plan_buckets([5, 3, 6], bucket_size=8)
    >>> layout.param_ranges
    ((0, 5), (5, 8), (8, 14))
    >>> [(b.start, b.end, b.params) for b in layout.buckets]
    [(0, 8, (0, 1)), (8, 14, (2,))]

Backward fills bucket 0 first (parameters go in reverse registration order), so its
all-reduce starts while the gradients of bucket 1 are still being computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Bucket", "BufferLayout", "plan_buckets", "DEFAULT_BUCKET_SIZE"]

#: Default bucket size in elements (25 MiB of fp32, torch DDP's ``bucket_cap_mb`` default),
#: so that a default vemesh DDP and a default torch DDP issue the same collectives.
DEFAULT_BUCKET_SIZE = 25 * 1024 * 1024 // 4


@dataclass(frozen=True)
class Bucket:
    """One bucket: a contiguous, padded range ``[start, end)`` of the buffer.

    Args:
        index: position of the bucket in the buffer; collectives are issued in this order.
        start: first element of the bucket in the buffer.
        end: one past the last element, padding included.
        params: indices (in buffer order) of the parameters stored in the bucket.
    """

    index: int
    start: int
    end: int
    params: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements in the bucket, padding included."""
        return self.end - self.start


@dataclass(frozen=True)
class BufferLayout:
    """Where every parameter and bucket lives in one flat buffer.

    Args:
        param_ranges: ``(start, end)`` of each parameter, in buffer order.
        buckets: the buckets, in buffer order; together they cover ``[0, numel)``.
        numel: total buffer length, padding included.
    """

    param_ranges: tuple[tuple[int, int], ...]
    buckets: tuple[Bucket, ...]
    numel: int

    def bucket_of_param(self) -> tuple[int, ...]:
        """For each parameter (buffer order), the index of the bucket that holds it."""
        owner = [0] * len(self.param_ranges)
        for bucket in self.buckets:
            for i in bucket.params:
                owner[i] = bucket.index
        return tuple(owner)


def plan_buckets(numels: Sequence[int], bucket_size: int) -> BufferLayout:
    """Lay parameters out back to back and cut the buffer into buckets.

    A bucket is closed as soon as it holds at least ``bucket_size`` elements, so a bucket
    never splits a parameter and may exceed ``bucket_size`` by less than one parameter. A
    bucket that would be empty (only zero-element parameters) gets one padding element.

    Args:
        numels: element count of each parameter, in the order they go into the buffer.
        bucket_size: target bucket size in elements (> 0).

    Returns:
        The :class:`BufferLayout`.
    """
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of elements, got {bucket_size!r}")
    param_ranges: list[tuple[int, int]] = []
    buckets: list[Bucket] = []
    offset = bucket_start = 0
    members: list[int] = []
    for i, n in enumerate(numels):
        if n < 0:
            raise ValueError(f"numels[{i}]={n} is negative")
        param_ranges.append((offset, offset + n))
        offset += n
        members.append(i)
        if offset - bucket_start >= bucket_size or i == len(numels) - 1:
            end = bucket_start + max(offset - bucket_start, 1)
            buckets.append(Bucket(len(buckets), bucket_start, end, tuple(members)))
            offset = bucket_start = end
            members = []
    return BufferLayout(tuple(param_ranges), tuple(buckets), offset)
