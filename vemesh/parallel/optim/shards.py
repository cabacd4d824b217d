"""Pure arithmetic for ZeRO-1: which slice of a flat buffer each data-parallel rank owns.

Nothing here touches ``torch.distributed``; it runs (and is tested) without a process group.

A flat buffer of ``numel`` elements is padded to ``dp_size * shard_size`` and cut into
``dp_size`` equal slices; DP rank ``r`` owns slice ``r`` and keeps optimizer state only for the
parameter elements inside it. With parameters of 5, 3 and 6 elements (ranges ``(0, 5)``,
``(5, 8)``, ``(8, 14)``) and ``dp_size=2``::

    >>> shard_range(14, dp_rank=0, dp_size=2), shard_range(14, dp_rank=1, dp_size=2)
    ((0, 7), (7, 14))
    >>> shard_pieces(((0, 5), (5, 8), (8, 14)), 0, 7)
    [Piece(param=0, start=0, end=5), Piece(param=1, start=5, end=7)]

DP rank 0 steps all of parameter 0 and the first 2 elements of parameter 1; DP rank 1 steps the
rest. Over all DP ranks the pieces cover every parameter element exactly once.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Piece", "shard_size", "shard_range", "shard_pieces", "contiguous_runs"]


@dataclass(frozen=True)
class Piece:
    """The part ``[start, end)`` (buffer coordinates) of parameter ``param`` inside one rank's slice."""

    param: int
    start: int
    end: int


def shard_size(numel: int, dp_size: int) -> int:
    """Elements per DP rank for a buffer of ``numel`` elements (the buffer is padded up to ``dp_size`` times this)."""
    if dp_size <= 0:
        raise ValueError(f"dp_size must be positive, got {dp_size}")
    return max(-(-numel // dp_size), 1)


def shard_range(numel: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """The padded buffer range ``[start, end)`` that ``dp_rank`` owns.

    Args:
        numel: elements in the buffer (before padding).
        dp_rank: local rank in the data-parallel group.
        dp_size: size of the data-parallel group.

    Returns:
        ``(start, end)``; may extend past ``numel`` into the padding.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
    size = shard_size(numel, dp_size)
    return dp_rank * size, (dp_rank + 1) * size


def shard_pieces(param_ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> list[Piece]:
    """Every non-empty intersection of a parameter range with the slice ``[lo, hi)``, in buffer order."""
    pieces = []
    for i, (start, end) in enumerate(param_ranges):
        start, end = max(lo, start), min(hi, end)
        if start < end:
            pieces.append(Piece(i, start, end))
    return pieces


def contiguous_runs(pieces: Sequence[Piece], keys: Sequence[Hashable]) -> list[tuple[Hashable, int, int]]:
    """Merge neighbouring pieces with the same key into ``(key, start, end)`` runs.

    Args:
        pieces: pieces in buffer order (from :func:`shard_pieces`).
        keys: one key per piece (e.g. the optimizer param group); pieces whose key is ``None``
            are left out.

    Returns:
        The runs in buffer order. With one key for all pieces and no gaps between parameters,
        a rank gets a single run.
    """
    runs: list[tuple[Hashable, int, int]] = []
    for piece, key in zip(pieces, keys, strict=True):
        if key is None:
            continue
        if runs and runs[-1][0] == key and runs[-1][2] == piece.start:
            runs[-1] = (key, runs[-1][1], piece.end)
        else:
            runs.append((key, piece.start, piece.end))
    return runs
