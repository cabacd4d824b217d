"""Pure rank arithmetic for an n-D device mesh: no process group, no devices.

A :class:`MeshLayout` is the row-major mesh that ``init_device_mesh`` builds:
global rank ``r`` sits at the coordinate whose dot product with the strides is
``r``. Everything here is O(ndim) integer arithmetic, so it answers questions
about *any* rank of a 16384-rank world in about a microsecond, on a laptop.

A *group* is named by a tuple of dim indices ``dims``. The group of rank ``r``
along ``dims`` is every rank that agrees with ``r`` on all the other dims; its
members are ordered row-major over ``dims`` (in the order given), which is the
order torch uses for a slice ``mesh["DP", "TP"]`` and for ``_flatten``. The
empty tuple is the group of one: ``r`` itself. This is how vemesh treats a
standard strategy that the mesh does not have (its size is 1).

Example on shape ``(PP=2, DP=2, TP=2)``::

    rank:  0 1 2 3 4 5 6 7
    PP:    0 0 0 0 1 1 1 1
    DP:    0 0 1 1 0 0 1 1
    TP:    0 1 0 1 0 1 0 1

    layout.group_ranks(5, (2,))    -> [4, 5]         # TP group of rank 5
    layout.group_ranks(5, (0,))    -> [1, 5]         # PP group of rank 5
    layout.group_ranks(5, (1, 2))  -> [4, 5, 6, 7]   # DP x TP of rank 5
"""

from __future__ import annotations

import difflib
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["MeshLayout", "as_index", "check_dim_names", "unknown_name_error"]


_MEMO_LIMIT = 1 << 16  # coordinates remembered per layout (a few MB at most)


def _as_int(value: object) -> int | None:
    """``value`` as a Python int if it is an integer (numpy and torch ints too), else None; bools are not."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def as_index(value: object, what: str) -> int:
    """``value`` as a Python int, or ``TypeError`` naming ``what``: numpy and torch integers count, bools do not."""
    index = _as_int(value)
    if index is None:
        raise TypeError(
            f"{what} must be an integer (numpy and torch integer scalars count, bool does not); "
            f"got {value!r} of type {type(value).__name__}"
        )
    return index


def check_dim_names(names: object) -> tuple[str, ...]:
    """``names`` as a tuple, checked: an ordered sequence of distinct identifier-like strings.

    ``("DP", "TP")`` passes; ``{"DP", "TP"}`` (its order depends on the hash seed), ``(" DP",)``
    and ``("D-P",)`` raise ``ValueError``; ``(1, 2)`` raises ``TypeError``.
    """
    if isinstance(names, (set, frozenset, dict)):
        raise ValueError(
            f"dim names must be an ordered sequence (a tuple or list); got a {type(names).__name__}, "
            f"whose order changes from run to run: {sorted(map(str, names))!r}"
        )
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"dim names must be a tuple or list of strings; got {names!r}")
    out = tuple(names)
    for name in out:
        if not isinstance(name, str):
            raise TypeError(f"dim names must be strings; got {name!r} of type {type(name).__name__} in {out!r}")
        if not name.isidentifier():
            raise ValueError(
                f"dim name {name!r} is not a plain name (letters, digits and '_', not starting with a digit, "
                f"no spaces); got {out!r}"
            )
    dupes = sorted({n for n in out if out.count(n) > 1})
    if dupes:
        raise ValueError(f"dim names must be unique; {dupes} repeat in {out}")
    return out


def unknown_name_error(kind: str, name: object, valid: Sequence[str]) -> KeyError:
    """Build the ``KeyError`` for an unknown name, listing the valid ones and the closest match."""
    message = f"unknown {kind} {name!r}; valid {kind}s are {list(valid)}"
    if isinstance(name, str):
        lowered = {v.lower(): v for v in valid}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.5)
        if close:
            message += f"; did you mean {lowered[close[0]]!r}?"
    return KeyError(message)


@dataclass(frozen=True)
class MeshLayout:
    """An immutable, hashable row-major mesh: named dims, sizes and strides.

    Args:
        shape: size of each dim, outermost first. All sizes must be positive.
        dim_names: one unique name per dim.
        first_rank: the global rank of the mesh's first member. A mesh over ranks 4..7 of an
            8-rank world has ``first_rank=4``; every rank in and out of it is a global rank.
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    first_rank: int = 0
    strides: tuple[int, ...] = field(init=False, repr=False, compare=False)
    world_size: int = field(init=False, repr=False, compare=False)
    _pairs: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    _memo: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shape = tuple(as_index(s, "a mesh size") for s in self.shape)
        names = check_dim_names(self.dim_names)
        if not shape:
            raise ValueError("a mesh needs at least one dim; got shape ()")
        if any(s < 1 for s in shape):
            raise ValueError(f"mesh sizes must be positive integers; got shape {shape}")
        if len(names) != len(shape):
            raise ValueError(
                f"need one dim name per dim: shape {shape} has {len(shape)} dims "
                f"but dim_names {names} has {len(names)}"
            )
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        first = as_index(self.first_rank, "first_rank")
        if first < 0:
            raise ValueError(f"first_rank must be a global rank (>= 0); got {first}")
        object.__setattr__(self, "first_rank", first)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dim_names", names)
        object.__setattr__(self, "strides", tuple(strides))
        object.__setattr__(self, "world_size", math.prod(shape))
        object.__setattr__(self, "_pairs", tuple(zip(strides, shape)))
        object.__setattr__(self, "_memo", {})

    @property
    def ndim(self) -> int:
        return len(self.shape)

    # ------------------------------------------------------------------ lookups
    def dim_index(self, dim: str | int) -> int:
        """Index of ``dim`` (a name, or an index counted from the outermost dim)."""
        if isinstance(dim, str):
            try:
                return self.dim_names.index(dim)
            except ValueError:
                raise unknown_name_error("dim name", dim, self.dim_names) from None
        if isinstance(dim, int) and not isinstance(dim, bool):
            if 0 <= dim < self.ndim:
                return dim
            raise ValueError(f"dim index {dim} is out of range for a {self.ndim}-D mesh; valid: 0..{self.ndim - 1}")
        raise TypeError(f"a dim is a name (str) or an index (int); got {dim!r}")

    def check_rank(self, rank: int) -> int:
        """``rank``'s index in the mesh (``rank - first_rank``) if it is a member; ``TypeError`` if not an integer, else ``ValueError``."""
        value = as_index(rank, "a global rank")
        first = self.first_rank
        if not first <= value < first + self.world_size:
            raise ValueError(f"global rank {value} is out of range; valid: {first}..{first + self.world_size - 1}")
        return value - first

    def group_size(self, dims: tuple[int, ...]) -> int:
        """Number of ranks in every group along ``dims`` (1 for ``()``)."""
        return math.prod(self.shape[d] for d in dims)

    # ------------------------------------------------- coordinate <-> global rank
    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Coordinate of global ``rank``: on (2, 4), rank 6 -> (1, 2) and rank 1 -> (0, 1)."""
        if type(rank) is int:  # exact ints only: True must not find rank 1's entry
            found = self._memo.get(rank)
            if found is not None:
                return found
        index = self.check_rank(rank)
        coordinate = tuple([(index // st) % sz for st, sz in self._pairs])
        if len(self._memo) < _MEMO_LIMIT:
            self._memo[index + self.first_rank] = coordinate
        return coordinate

    def rank(self, coordinate: Sequence[int]) -> int:
        """Global rank at ``coordinate``: on (2, 4), (1, 2) -> 6 and (0, 1) -> 1."""
        rank = 0
        if (type(coordinate) is tuple or type(coordinate) is list) and len(coordinate) == self.ndim:
            for c, size, st in zip(coordinate, self.shape, self.strides):
                if type(c) is not int or not 0 <= c < size:
                    break
                rank += c * st
            else:
                return rank + self.first_rank
        if isinstance(coordinate, (str, bytes)) or not isinstance(coordinate, Sequence):
            raise TypeError(
                f"a coordinate is a sequence of integers, one per dim {self.dim_names} (or, in VeDeviceMesh queries, "
                f"a mapping by dim name); got {coordinate!r}"
            )
        given = tuple(coordinate)
        coordinate = tuple(as_index(c, f"coordinate entry {name}") for name, c in zip(self.dim_names, given))
        if len(coordinate) != self.ndim:
            raise ValueError(
                f"coordinate {coordinate} has {len(coordinate)} entries; this mesh "
                f"{dict(zip(self.dim_names, self.shape))} needs {self.ndim}"
            )
        for name, c, size in zip(self.dim_names, coordinate, self.shape):
            if type(c) is not int or not 0 <= c < size:
                raise ValueError(f"coordinate {given}: {name}={c!r} is out of range; valid: 0..{size - 1}")
        return self.first_rank + sum(c * st for c, st in zip(coordinate, self.strides))

    # ----------------------------------------------------------------- groups
    def index_in_group(self, rank: int, dims: tuple[int, ...]) -> int:
        """Position of ``rank`` inside its group along ``dims`` (row-major over ``dims``)."""
        rank = self.check_rank(rank)
        index = 0
        for d in dims:
            index = index * self.shape[d] + (rank // self.strides[d]) % self.shape[d]
        return index

    def member(self, rank: int, dims: tuple[int, ...], index: int) -> int:
        """Global rank of member ``index`` of ``rank``'s group along ``dims``."""
        rank = self.check_rank(rank)
        size = self.group_size(dims)
        given, index = index, as_index(index, "a local rank")
        if not 0 <= index < size:
            names = "x".join(self.dim_names[d] for d in dims) or "(none)"
            raise ValueError(f"local rank {given!r} is out of range along {names} (size {size}); valid: 0..{size - 1}")
        base = self._base(rank, dims)
        for d in reversed(dims):
            index, c = divmod(index, self.shape[d])
            base += c * self.strides[d]
        return base + self.first_rank

    def group_ranks(self, rank: int, dims: tuple[int, ...]) -> list[int]:
        """Every global rank in ``rank``'s group along ``dims``, in member order."""
        rank = self.check_rank(rank)
        return self._ranks_from(self._base(rank, dims), dims)

    def group_index(self, rank: int, dims: tuple[int, ...]) -> int:
        """Which group along ``dims`` holds ``rank``, counting groups as :meth:`all_groups` lists them."""
        rank = self.check_rank(rank)
        index = 0
        for d in self.complement(dims):
            index = index * self.shape[d] + (rank // self.strides[d]) % self.shape[d]
        return index

    def all_groups(self, dims: tuple[int, ...]) -> list[list[int]]:
        """The world partitioned into groups along ``dims``, ordered row-major over the other dims.

        On (2, 4) with names (DP, TP): ``all_groups((1,))`` (TP) is
        ``[[0, 1, 2, 3], [4, 5, 6, 7]]`` and ``all_groups((0,))`` (DP) is
        ``[[0, 4], [1, 5], [2, 6], [3, 7]]``.
        """
        return [self._ranks_from(base, dims) for base in self._offsets(self.complement(dims))]

    def group_at(self, dims: tuple[int, ...], index: int) -> list[int]:
        """Group number ``index`` along ``dims``: ``all_groups(dims)[index]`` without building the rest."""
        others = self.complement(dims)
        count = self.world_size // self.group_size(dims)
        index = as_index(index, "a group index")
        if not 0 <= index < count:
            raise ValueError(f"group index {index!r} is out of range; valid: 0..{count - 1}")
        base = 0
        for d in reversed(others):
            index, c = divmod(index, self.shape[d])
            base += c * self.strides[d]
        return self._ranks_from(base, dims)

    def complement(self, dims: tuple[int, ...]) -> tuple[int, ...]:
        """The dims not in ``dims``, in mesh order."""
        return tuple(d for d in range(self.ndim) if d not in dims)

    def neighbor(self, rank: int, dim: int, offset: int = 1, wrap: bool = False) -> int | None:
        """The global rank ``offset`` steps from ``rank`` along ``dim``, or None past an edge.

        On (PP=4, TP=2): ``neighbor(3, 0, +1)`` is 5; ``neighbor(7, 0, +1)`` is None,
        and 1 with ``wrap=True``.
        """
        rank = self.check_rank(rank)
        c = (rank // self.strides[dim]) % self.shape[dim]
        target = c + offset
        if wrap:
            target %= self.shape[dim]
        elif not 0 <= target < self.shape[dim]:
            return None
        return self.first_rank + rank + (target - c) * self.strides[dim]

    # ---------------------------------------------------------------- helpers
    def _base(self, rank: int, dims: tuple[int, ...]) -> int:
        """``rank`` with its coordinate on ``dims`` set to zero."""
        for d in dims:
            rank -= ((rank // self.strides[d]) % self.shape[d]) * self.strides[d]
        return rank

    def _ranks_from(self, base: int, dims: tuple[int, ...]) -> list[int]:
        """Global ranks of the group whose first member has mesh index ``base``."""
        base += self.first_rank
        return [base + off for off in self._offsets(dims)]

    def _offsets(self, dims: tuple[int, ...]) -> list[int]:
        return [
            sum(c * self.strides[d] for c, d in zip(cs, dims))
            for cs in itertools.product(*(range(self.shape[d]) for d in dims))
        ]
