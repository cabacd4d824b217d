"""Pure arithmetic for the contiguous gradient buffer: where each parameter lives, how
the buffer splits into buckets, and which slice of every bucket each data-parallel rank owns.

Nothing here touches ``torch.distributed``; it runs (and is tested) without a process group.

A small example: three parameters of 5, 3 and 6 elements, ``bucket_size=8``, padded for a
data-parallel size of 2::

    >>> layout = plan_buckets([5, 3, 6], bucket_size=8, pad_to=2)
    >>> layout.param_ranges
    ((0, 5), (5, 8), (8, 14))
    >>> [(b.start, b.end, b.params) for b in layout.buckets]
    [(0, 8, (0, 1)), (8, 14, (2,))]
    >>> layout.buckets[0].shard(dp_rank=0, dp_size=2), layout.buckets[0].shard(dp_rank=1, dp_size=2)
    ((0, 4), (4, 8))

DP rank 0 owns elements ``[0, 4)`` and ``[8, 11)``; DP rank 1 owns ``[4, 8)`` and ``[11, 14)``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Bucket", "BufferLayout", "Piece", "plan_buckets", "shard_pieces", "contiguous_runs"]

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

    def shard(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """The buffer range ``[start, end)`` of this bucket that ``dp_rank`` owns.

        Args:
            dp_rank: local rank in the data-parallel group.
            dp_size: size of the data-parallel group; must divide :attr:`numel`.

        Returns:
            ``(start, end)`` in buffer coordinates. For a bucket ``[0, 8)`` and ``dp_size=2``,
            DP rank 0 gets ``(0, 4)`` and DP rank 1 gets ``(4, 8)``.
        """
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
        if self.numel % dp_size:
            raise ValueError(f"bucket {self.index} has {self.numel} elements, not divisible by dp_size={dp_size}")
        size = self.numel // dp_size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


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


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies inside a rank's shard of a bucket.

    Args:
        param: index of the parameter (buffer order).
        bucket: index of the bucket.
        start: first buffer element of the piece.
        end: one past the last buffer element of the piece.
        param_offset: offset of ``start`` inside the parameter's flattened local tensor.
    """

    param: int
    bucket: int
    start: int
    end: int
    param_offset: int


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_buckets(numels: Sequence[int], bucket_size: int, pad_to: int = 1) -> BufferLayout:
    """Lay parameters out back to back and cut the buffer into buckets.

    A bucket is closed as soon as it holds at least ``bucket_size`` elements, so a bucket
    never splits a parameter and may exceed ``bucket_size`` by less than one parameter. Each
    bucket is then padded with zeros to a multiple of ``pad_to`` (the data-parallel size when a
    distributed optimizer shards it, else 1).

    Args:
        numels: element count of each parameter, in the order they go into the buffer.
        bucket_size: target bucket size in elements (> 0).
        pad_to: every bucket's length is a multiple of this (> 0).

    Returns:
        The :class:`BufferLayout`.
    """
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of elements, got {bucket_size!r}")
    if isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to <= 0:
        raise ValueError(f"pad_to must be a positive int, got {pad_to!r}")
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
            end = bucket_start + _round_up(max(offset - bucket_start, 1), pad_to)
            buckets.append(Bucket(len(buckets), bucket_start, end, tuple(members)))
            offset = bucket_start = end
            members = []
    return BufferLayout(tuple(param_ranges), tuple(buckets), offset)


def shard_pieces(layout: BufferLayout, dp_rank: int, dp_size: int) -> list[Piece]:
    """Every parameter piece that falls in ``dp_rank``'s shard of each bucket.

    Args:
        layout: the buffer layout (planned with ``pad_to`` a multiple of ``dp_size``).
        dp_rank: local rank in the data-parallel group.
        dp_size: size of the data-parallel group.

    Returns:
        The pieces in buffer order. Over all DP ranks the pieces cover every parameter
        element exactly once; padding belongs to no piece.
    """
    pieces = []
    for bucket in layout.buckets:
        lo, hi = bucket.shard(dp_rank, dp_size)
        for i in bucket.params:
            p_start, p_end = layout.param_ranges[i]
            start, end = max(lo, p_start), min(hi, p_end)
            if start < end:
                pieces.append(Piece(i, bucket.index, start, end, start - p_start))
    return pieces


def contiguous_runs(pieces: Sequence[Piece], keys: Sequence[Hashable]) -> list[tuple[Hashable, int, int]]:
    """Merge neighbouring pieces of the same bucket and key into ``(key, start, end)`` runs.

    Args:
        pieces: pieces in buffer order (from :func:`shard_pieces`).
        keys: one key per piece (e.g. the optimizer param group); pieces whose key is ``None``
            are left out.

    Returns:
        The runs in buffer order. With one key for all pieces, a rank gets one run per bucket.
    """
    runs: list[tuple[Hashable, int, int]] = []
    last_bucket = -1
    for piece, key in zip(pieces, keys, strict=True):
        if key is None:
            continue
        if runs and runs[-1][0] == key and runs[-1][2] == piece.start and last_bucket == piece.bucket:
            runs[-1] = (key, runs[-1][1], piece.end)
        else:
            runs.append((key, piece.start, piece.end))
        last_bucket = piece.bucket
    return runs
