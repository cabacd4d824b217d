"""Mode arithmetic: a dim of a mesh as (size, stride) pairs over the mesh's positions.

Every named dim of a :class:`~vemesh.layout.MeshLayout` (a mesh dim, a flattened
dim, a part of a split) is a tuple of *modes* ``((size, stride), ...)``, outermost
first, over the mesh positions ``0 .. world-1`` (global rank minus the mesh's first
rank). This is the layout algebra torch's ``_MeshLayout`` uses (after CuTe), kept
to the few integer functions vemesh needs and written without torch.

On the row-major mesh ``(DP=4, CP=2, TP=2)`` of 16 ranks::

    DP = ((4, 4),)          CP = ((2, 2),)          TP = ((2, 1),)
    DP x CP flattened = ((4, 4), (2, 2)) -> coalesced ((8, 2),)
    split (8, 2) into (2, 4): EDP = ((2, 8),), EP = ((4, 2),)

so rank 5's EP group is ``5 - 4 = 1`` plus the offsets ``0, 2, 4, 6``: ``[1, 3, 5, 7]``.

A :class:`Group` answers for the groups along some modes: a rank's index in its
group, the member at an index, the group's ranks, and which group holds a rank
(groups are counted row-major over the other modes, outermost first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Group", "Mode", "Modes", "NamedDim", "coalesce", "complement", "divide"]

Mode = tuple[int, int]  # (size, stride)
Modes = tuple[Mode, ...]


@dataclass(frozen=True)
class NamedDim:
    """One name of a layout: its size, its modes, and the atoms (dims that are not merges) it covers.

    ``parts`` is ``(name,)`` for a mesh dim or a split part, and the merged dims, in order, for a
    flattened one. ``given`` is what :meth:`MeshLayout.flatten` was given (empty for an atom).
    """

    name: str
    size: int
    modes: Modes
    parts: tuple[str, ...]
    given: tuple[str, ...] = ()

    @property
    def is_atom(self) -> bool:
        return self.parts == (self.name,)


def coalesce(modes: Modes) -> Modes:
    """Drop size-1 modes and merge neighbours that are one contiguous run: ``((4, 4), (2, 2))`` -> ``((8, 2),)``."""
    out: list[Mode] = []
    for size, stride in modes:
        if size == 1:
            continue
        if out and out[-1][1] == size * stride:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return tuple(out)


def complement(modes: Modes, world: int) -> Modes | None:
    """The modes that, with ``modes``, tile ``0 .. world-1``; None when ``modes`` overlap or cannot tile it.

    ``complement(((2, 2),), 8)`` is ``((2, 4), (2, 1))``: the groups along stride 2 are counted
    over strides 4 and 1. ``((2, 1), (2, 1))`` (a mode used twice) gives None.
    """
    out: list[Mode] = []
    covered = 1  # every stride below this is taken
    for size, stride in sorted(modes, key=lambda m: m[1]):
        if stride < covered or stride % covered:
            return None
        if stride > covered:
            out.append((stride // covered, covered))
        covered = stride * size
    if world % covered:
        return None
    if world > covered:
        out.append((world // covered, covered))
    return coalesce(tuple(reversed(out)))


def divide(modes: Modes, sizes: tuple[int, ...]) -> tuple[Modes, ...] | None:
    """Split the index space of ``modes`` row-major into ``sizes``: the modes of each part, or None.

    ``divide(((8, 2),), (2, 4))`` is ``(((2, 8),), ((4, 2),))``. The parts must fall on the
    modes' boundaries: ``divide(((3, 4), (2, 1)), (2, 3))`` is None, since no part of size 3
    is one stride pattern over those ranks (torch's ``_unflatten`` refuses the same).
    """
    remaining = list(reversed(modes))  # innermost first
    parts: list[Modes] = []
    for size in reversed(sizes):
        taken: list[Mode] = []
        while size > 1:
            if not remaining:
                return None
            s, t = remaining[0]
            if s <= size:
                if size % s:
                    return None
                taken.append((s, t))
                remaining.pop(0)
                size //= s
            else:
                if s % size:
                    return None
                taken.append((size, t))
                remaining[0] = (s // size, t * size)
                size = 1
        parts.append(coalesce(tuple(reversed(taken))))
    return tuple(reversed(parts))


class Group:
    """The groups of a ``world``-position mesh along ``modes``; positions, not global ranks.

    Build it only for modes that :func:`complement` accepts (a sub-mesh of the world).
    """

    __slots__ = ("modes", "size", "count", "others", "_offsets", "_firsts")

    def __init__(self, modes: Modes, others: Modes, world: int) -> None:
        self.modes = modes
        self.others = others
        self.size = math.prod(s for s, _ in modes)
        self.count = world // self.size
        self._offsets: list[int] | None = None
        self._firsts: list[int] | None = None

    def index(self, x: int) -> int:
        """Position ``x``'s index inside its group (row-major over the modes)."""
        return _digits(x, self.modes)

    def base(self, x: int) -> int:
        """The first member of ``x``'s group: ``x`` with its digits along the modes set to zero."""
        for size, stride in self.modes:
            x -= ((x // stride) % size) * stride
        return x

    def place(self, base: int, index: int) -> int:
        """The member at ``index`` of the group whose first member is ``base``."""
        return base + _offset(index, self.modes)

    def offsets(self) -> list[int]:
        """Each member's distance from the group's first member, in member order."""
        if self._offsets is None:
            self._offsets = _span(self.modes)
        return self._offsets

    def members(self, x: int) -> list[int]:
        """The positions of ``x``'s group, in member order."""
        base = self.base(x)
        return [base + o for o in self.offsets()]

    def which(self, x: int) -> int:
        """Which group holds ``x``, counting groups row-major over the other modes."""
        return _digits(x, self.others)

    def first_of(self, k: int) -> int:
        """The first member of group number ``k``."""
        return _offset(k, self.others)

    def firsts(self) -> list[int]:
        """The first member of every group, in group order."""
        if self._firsts is None:
            self._firsts = _span(self.others)
        return self._firsts


def _digits(x: int, modes: Modes) -> int:
    """``x``'s digits along ``modes``, read as one row-major number (outermost mode most significant)."""
    index = 0
    for size, stride in modes:
        index = index * size + (x // stride) % size
    return index


def _offset(index: int, modes: Modes) -> int:
    """The inverse of :func:`_digits` from position 0: the offset whose digits along ``modes`` spell ``index``."""
    offset = 0
    for size, stride in reversed(modes):
        index, digit = divmod(index, size)
        offset += digit * stride
    return offset


def _span(modes: Modes) -> list[int]:
    """Every offset that ``modes`` reach, row-major (outermost mode slowest)."""
    out = [0]
    for size, stride in modes:
        out = [o + i * stride for o in out for i in range(size)]
    return out
