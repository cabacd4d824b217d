"""Axis arithmetic: a dim of a mesh as (size, stride) pairs over the mesh's positions.

Every named dim of a :class:`~vemesh.layout.MeshLayout` (a mesh dim, a flattened
dim, a part of a split) is a tuple of *axes* ``((size, stride), ...)``, outermost
first, over the mesh positions ``0 .. world-1`` (global rank minus the mesh's first
rank). This is the layout algebra torch's ``_MeshLayout`` uses (after CuTe, which calls an axis a mode), kept
to the few integer functions vemesh needs and written without torch.

On the row-major mesh ``(DP=4, CP=2, TP=2)`` of 16 ranks::

    DP = ((4, 4),)          CP = ((2, 2),)          TP = ((2, 1),)
    DP x CP flattened = ((4, 4), (2, 2)) -> coalesced ((8, 2),)
    split (8, 2) into (2, 4): EDP = ((2, 8),), EP = ((4, 2),)

so rank 5's EP group is ``5 - 4 = 1`` plus the offsets ``0, 2, 4, 6``: ``[1, 3, 5, 7]``.

A :class:`Group` answers for the groups along some axes: a rank's index in its
group, the member at an index, the group's ranks, and which group holds a rank
(groups are counted row-major over the other axes, outermost first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Group", "Axis", "Axes", "NamedDim", "coalesce", "complement", "divide"]

Axis = tuple[int, int]  # (size, stride)
Axes = tuple[Axis, ...]


@dataclass(frozen=True)
class NamedDim:
    """One name of a layout: its size, its axes, and the atoms (dims that are not merges) it covers.

    ``parts`` is ``(name,)`` for a mesh dim or a split part, and the merged dims, in order, for a
    flattened one. ``given`` is what :meth:`MeshLayout.flatten` was given (empty for an atom).
    """

    name: str
    size: int
    axes: Axes
    parts: tuple[str, ...]
    given: tuple[str, ...] = ()

    @property
    def is_atom(self) -> bool:
        return self.parts == (self.name,)


def coalesce(axes: Axes) -> Axes:
    """Drop size-1 axes and merge neighbours that are one contiguous run: ``((4, 4), (2, 2))`` -> ``((8, 2),)``."""
    out: list[Axis] = []
    for size, stride in axes:
        if size == 1:
            continue
        if out and out[-1][1] == size * stride:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return tuple(out)


def complement(axes: Axes, world: int) -> Axes | None:
    """The axes that, with ``axes``, tile ``0 .. world-1``; None when ``axes`` overlap or cannot tile it.

    ``complement(((2, 2),), 8)`` is ``((2, 4), (2, 1))``: the groups along stride 2 are counted
    over strides 4 and 1. ``((2, 1), (2, 1))`` (a axis used twice) gives None.
    """
    out: list[Axis] = []
    covered = 1  # every stride below this is taken
    for size, stride in sorted(axes, key=lambda m: m[1]):
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


def divide(axes: Axes, sizes: tuple[int, ...]) -> tuple[Axes, ...] | None:
    """Split the index space of ``axes`` row-major into ``sizes``: the axes of each part, or None.

    ``divide(((8, 2),), (2, 4))`` is ``(((2, 8),), ((4, 2),))``. The parts must fall on the
    axes' boundaries: ``divide(((3, 4), (2, 1)), (2, 3))`` is None, since no part of size 3
    is one stride pattern over those ranks (torch's ``_unflatten`` refuses the same).
    """
    remaining = list(reversed(axes))  # innermost first
    parts: list[Axes] = []
    for size in reversed(sizes):
        taken: list[Axis] = []
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
    """The groups of a ``world``-position mesh along ``axes``; positions, not global ranks.

    Build it only for axes that :func:`complement` accepts (a sub-mesh of the world).
    """

    __slots__ = ("axes", "size", "count", "others", "_offsets", "_firsts")

    def __init__(self, axes: Axes, others: Axes, world: int) -> None:
        self.axes = axes
        self.others = others
        self.size = math.prod(s for s, _ in axes)
        self.count = world // self.size
        self._offsets: list[int] | None = None
        self._firsts: list[int] | None = None

    def index(self, x: int) -> int:
        """Position ``x``'s index inside its group (row-major over the axes)."""
        return _digits(x, self.axes)

    def base(self, x: int) -> int:
        """The first member of ``x``'s group: ``x`` with its digits along the axes set to zero."""
        for size, stride in self.axes:
            x -= ((x // stride) % size) * stride
        return x

    def place(self, base: int, index: int) -> int:
        """The member at ``index`` of the group whose first member is ``base``."""
        return base + _offset(index, self.axes)

    def offsets(self) -> list[int]:
        """Each member's distance from the group's first member, in member order."""
        if self._offsets is None:
            self._offsets = _span(self.axes)
        return self._offsets

    def members(self, x: int) -> list[int]:
        """The positions of ``x``'s group, in member order."""
        base = self.base(x)
        return [base + o for o in self.offsets()]

    def which(self, x: int) -> int:
        """Which group holds ``x``, counting groups row-major over the other axes."""
        return _digits(x, self.others)

    def first_of(self, k: int) -> int:
        """The first member of group number ``k``."""
        return _offset(k, self.others)

    def firsts(self) -> list[int]:
        """The first member of every group, in group order."""
        if self._firsts is None:
            self._firsts = _span(self.others)
        return self._firsts


def _digits(x: int, axes: Axes) -> int:
    """``x``'s digits along ``axes``, read as one row-major number (outermost axis most significant)."""
    index = 0
    for size, stride in axes:
        index = index * size + (x // stride) % size
    return index


def _offset(index: int, axes: Axes) -> int:
    """The inverse of :func:`_digits` from position 0: the offset whose digits along ``axes`` spell ``index``."""
    offset = 0
    for size, stride in reversed(axes):
        index, digit = divmod(index, size)
        offset += digit * stride
    return offset


def _span(axes: Axes) -> list[int]:
    """Every offset that ``axes`` reach, row-major (outermost axis slowest)."""
    out = [0]
    for size, stride in axes:
        out = [o + i * stride for o in out for i in range(size)]
    return out
