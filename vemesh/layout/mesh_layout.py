"""Pure rank arithmetic for an n-D device mesh and every name it has: no process group, no devices.

A :class:`MeshLayout` starts as the row-major mesh that ``init_device_mesh`` builds:
global rank ``r`` sits at the coordinate whose dot product with the strides is ``r``.
Every *name* of the layout is a :class:`NamedDim`, a tuple of (size, stride) axes
over the mesh (see :mod:`vemesh.layout.axes`):

* the mesh dims, one axis each;
* flattened dims (:meth:`MeshLayout.flatten`), the axes of the dims they merge;
* the parts of a split (:meth:`MeshLayout.split`). Splitting a mesh dim refines the mesh
  and keeps the old name as a flattened dim over its parts, so it answers as before.
  Splitting a flattened dim adds a *second factorization* of the same ranks (MoE's
  ``(EDP, EP)`` over ``DP x CP``) beside the first.

``flatten`` and ``split`` return new layouts; a layout never changes, and never loses a
name. A *group* is named by ``dims``: a name, a mesh-dim index, or a sequence of them
(which must be a sub-mesh of one factorization, in its order). The group of rank ``r``
along ``dims`` is every rank that agrees with ``r`` on all the other axes; its members
are ordered row-major over ``dims``, the order torch uses for ``mesh["DP", "TP"]`` and
``_flatten``. The empty tuple is the group of one: ``r`` itself.

Example on shape ``(PP=2, DP=2, TP=2)``::

    rank:  0 1 2 3 4 5 6 7
    PP:    0 0 0 0 1 1 1 1
    DP:    0 0 1 1 0 0 1 1
    TP:    0 1 0 1 0 1 0 1

    layout.group_ranks(5, "TP")           -> [4, 5]
    layout.group_ranks(5, "PP")           -> [1, 5]
    layout.group_ranks(5, ("DP", "TP"))   -> [4, 5, 6, 7]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

from vemesh.layout.algebra import flat_name as _flat_name, flatten as _flatten, split as _split
from vemesh.layout.axes import Group, NamedDim, coalesce, complement
from vemesh.layout.names import STANDARD_STRATEGIES, as_index, check_dim_names, other_spellings, standard_absent_error, unknown_name_error

__all__ = ["Dims", "MeshLayout", "NamedDim", "as_index", "check_dim_names", "unknown_name_error"]

#: A dim, or several: a name, a mesh-dim index (outermost is 0), or a sequence of them.
Dims = Union[str, int, Sequence[Union[str, int]]]

_MEMO_LIMIT = 1 << 16  # coordinates remembered per layout (a few MB at most)


@dataclass(frozen=True)
class MeshLayout:
    """An immutable, hashable mesh with named dims: the row-major base, plus flattened and split names.

    Args:
        shape: size of each mesh dim, outermost first. All sizes must be positive.
        dim_names: one unique name per mesh dim.
        first_rank: the global rank of the mesh's first member. A mesh over ranks 4..7 of an
            8-rank world has ``first_rank=4``; every rank in and out of it is a global rank.
        extra_dims: flattened dims and the atoms of other factorizations, as :meth:`flatten` and
            :meth:`split` make them (build layouts with those, not by hand).
        extra_factorizations: the atoms of each factorization beside the mesh dims.
        managed: names of dims outside this world whose membership changes per step (the fault-tolerant
            replica dim of :mod:`vemesh.ft`). Every name-taking method raises ``ValueError`` for them, naming
            who answers for such a dim: their rank arithmetic is not this layout's.
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    first_rank: int = 0
    extra_dims: tuple[NamedDim, ...] = ()
    extra_factorizations: tuple[tuple[str, ...], ...] = ()
    managed: tuple[str, ...] = ()
    strides: tuple[int, ...] = field(init=False, repr=False, compare=False)
    world_size: int = field(init=False, repr=False, compare=False)
    _named: dict[str, NamedDim] = field(init=False, repr=False, compare=False)
    _pairs: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    _memo: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _groups: dict[Any, tuple[tuple[str, ...], Group]] = field(init=False, repr=False, compare=False)

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
        named = {n: NamedDim(n, s, coalesce(((s, st),)), (n,)) for n, s, st in zip(names, shape, strides)}
        for dim in self.extra_dims:
            assert dim.name not in named, f"{dim.name!r} named twice"
            named[dim.name] = dim
        managed = check_dim_names(self.managed)
        if set(managed) & set(named):
            raise ValueError(f"managed dims {sorted(set(managed) & set(named))} are already dims of this mesh {tuple(named)}")
        for atoms in self.extra_factorizations:
            assert all(named[a].is_atom for a in atoms) and math.prod(named[a].size for a in atoms) == math.prod(shape)
        for attr, value in (("first_rank", first), ("shape", shape), ("dim_names", names), ("strides", tuple(strides)),
                            ("world_size", math.prod(shape)), ("_named", named), ("_pairs", tuple(zip(strides, shape))),
                            ("_memo", {}), ("_groups", {})):
            object.__setattr__(self, attr, value)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name: the mesh dims, then flattened and split names in the order they were made."""
        return tuple(self._named)

    @property
    def factorizations(self) -> tuple[tuple[str, ...], ...]:
        """The atoms of each factorization of the ranks: the mesh dims first, then one per split of a flattened dim."""
        return (self.dim_names, *self.extra_factorizations)

    def named(self, name: str) -> NamedDim:
        """The :class:`NamedDim` for ``name``; ``KeyError`` listing the valid names otherwise."""
        found = self._named.get(name) if isinstance(name, str) else None
        if found is None:
            self._check_managed(name)
            raise unknown_name_error("dim name", name, (*self.names, *self.managed))
        return found

    def with_managed(self, name: str) -> MeshLayout:
        """This layout plus ``name`` as a managed dim (see ``managed``), checked to be a new plain name."""
        (name,) = check_dim_names((name,))
        if name in self._named or name in self.managed:
            raise ValueError(f"{name!r} is already a dim of this mesh {(*self.names, *self.managed)}; pick another name")
        return replace(self, managed=(*self.managed, name))

    def _check_managed(self, name: object) -> None:
        if isinstance(name, str) and name in self.managed:
            raise ValueError(
                f"{name!r} is the fault-tolerant replica dim: torchft decides each step which replicas take part, and "
                "they are other jobs, outside this world, so the mesh keeps only the name. Ask the replicas "
                "(vemesh.ft.Replicas): replicas.size() is this step's count, replicas.index() this replica's place, "
                "replicas.group torchft's group; the name cannot be sized, ranked, combined with other dims, viewed "
                "as a torch DeviceMesh, flattened or split"
            )

    def has(self, name: object) -> bool:
        """Whether ``name`` is one of this layout's names."""
        return isinstance(name, str) and name in self._named

    # ------------------------------------------------------------------ names
    def dim_index(self, dim: str | int) -> int:
        """Index of a mesh dim: a name, or an index from the outermost dim (a negative one from the innermost, as torch's)."""
        if isinstance(dim, str):
            try:
                return self.dim_names.index(dim)
            except ValueError:
                raise unknown_name_error("dim name", dim, self.dim_names) from None
        if isinstance(dim, int) and not isinstance(dim, bool):
            if -self.ndim <= dim < self.ndim:
                return dim % self.ndim
            raise ValueError(f"dim index {dim} is out of range for a {self.ndim}-D mesh; valid: 0..{self.ndim - 1}, "
                             f"or -{self.ndim}..-1 counted from the innermost")
        raise TypeError(f"a dim is a name (str) or an index (int); got {dim!r}")

    def resolve(self, dims: Dims, absent_ok: bool = False) -> tuple[str, ...]:
        """The names that ``dims`` stand for, checked to be one sub-mesh; the one place names are resolved.

        ``absent_ok`` lets a standard strategy (``PP, DP, TP, CP, EP``) that this layout never had
        stand for the group of one. A name the layout has, flattened or split, always answers as
        itself. On ``(DP, CP, TP)`` with ``EP`` split out of ``DP x CP``: ``resolve(("EP", "TP"))`` is
        ``("EP", "TP")``; ``("TP", "EP")`` raises ``ValueError`` (a view, like torch's, takes its dims in mesh
        order), and so does ``("DP", "EP")`` (two factorizations). The group queries take any order.
        """
        return self._group(dims, absent_ok, ordered=True)[0]

    def standard_name(self, standard: str) -> str:
        """The name this layout gives the standard strategy ``standard``: itself, or its one spelling in another case.

        On ``("dp", "tp")``, ``standard_name("DP")`` is ``"dp"``; on ``("DP", "TP")`` it is ``"DP"``, and so it
        is wherever the mesh has no such dim (queries then answer as absent, or raise where it is spelled
        another way). veScale's method names (``get_data_parallel_rank``) ask through it.
        """
        if standard in self._named:
            return standard
        same = [n for n in self._named if n.lower() == standard.lower()]
        return same[0] if len(same) == 1 else standard

    def spell(self, dims: Dims) -> str:
        """``dims`` with each merged name spelled out: ``dp_replicate, dp_shard_cp=(dp_shard, cp)``."""
        out = []
        for part in [dims] if isinstance(dims, (str, int)) else list(dims):
            dim = self._named.get(part) if isinstance(part, str) else None
            out.append(f"{part}=({', '.join(dim.parts)})" if dim is not None and not dim.is_atom else str(part))
        return ", ".join(out)

    def _one(self, dim: object, absent_ok: bool) -> tuple[str, ...]:
        if isinstance(dim, str):
            if dim in self._named:
                return (dim,)
            self._check_managed(dim)
            if absent_ok and dim in STANDARD_STRATEGIES:
                spellings = other_spellings(dim, self.names, [n for n in self.names if self._named[n].is_atom])
                if spellings:  # "absent, size 1" would be silently wrong: the mesh has it under another name
                    raise standard_absent_error(dim, spellings, (*self.names, *self.managed))
                return ()
            err = unknown_name_error("dim name", dim, (*self.names, *self.managed))
            absent = [s for s in STANDARD_STRATEGIES if s not in self._named]  # not those the mesh has
            if absent_ok and absent:
                err.args = (err.args[0] + f" (absent standard strategies {absent} have size 1)",)
            raise err
        if isinstance(dim, int) and not isinstance(dim, bool):
            return (self.dim_names[self.dim_index(dim)],)
        raise TypeError(f"a dim is a name (str), an index (int) or a sequence of them; got {dim!r}")

    def _group(self, dims: Dims, absent_ok: bool = False, ordered: bool = False) -> tuple[tuple[str, ...], Group]:
        """The names of ``dims`` and their :class:`Group`, members row-major over ``dims`` as given (Megatron's
        ``_gen_rank_enum``: ``("TP", "CP")`` lists TP fastest); ``ordered`` also requires mesh order (views)."""
        key = (dims, absent_ok, ordered)
        try:
            return self._groups[key]
        except TypeError:  # a list: resolved every time
            key = None
        except KeyError:
            pass
        if isinstance(dims, (str, int)):
            names = self._one(dims, absent_ok)
        elif isinstance(dims, Sequence):
            names = tuple(n for d in dims for n in self._one(d, absent_ok))
            if len(names) > 1:
                self._check_sub_mesh(names, dims, ordered)
        else:
            raise TypeError(f"a dim is a name (str), an index (int) or a sequence of them; got {dims!r}")
        axes = tuple(m for n in names for m in self._named[n].axes)
        others = complement(axes, self.world_size)
        assert others is not None, f"{names} passed the sub-mesh check but overlap"
        found = (names, Group(axes, others, self.world_size))
        if key is not None and len(self._groups) < _MEMO_LIMIT:
            self._groups[key] = found
        return found

    def _check_sub_mesh(self, names: tuple[str, ...], dims: Dims, ordered: bool) -> None:
        atoms = [a for n in names for a in self._named[n].parts]
        if len(set(atoms)) != len(atoms):
            raise ValueError(f"dims {tuple(dims)} name the same dim twice: {self.spell(dims)}")
        holding = [f for f in self.factorizations if all(a in f for a in atoms)]
        if not holding:
            homes = "; ".join(f"{n} is in ({', '.join(self._home(n))})" for n in names)
            raise ValueError(
                f"dims ({self.spell(dims)}) mix two factorizations of the ranks: {homes}. "
                "A view takes all its dims from one factorization"
            )
        if ordered and not any([f.index(a) for a in atoms] == sorted(f.index(a) for a in atoms) for f in holding):
            raise ValueError(
                f"dims ({self.spell(dims)}) do not form a sub-mesh in mesh order {holding[0]}: a view, like torch's "
                "DeviceMesh, takes its dims in mesh order (MeshLayout's group queries take any order)"
            )

    def _home(self, name: str) -> tuple[str, ...]:
        parts = self._named[name].parts
        return next(f for f in self.factorizations if all(a in f for a in parts))

    # ------------------------------------------------------------- algebra
    def flatten(self, dims: Dims, name: str | None = None) -> MeshLayout:
        """This layout plus one flattened dim merging ``dims`` (a sub-mesh, in mesh order).

        On ``(DP=4, CP=2, TP=2)``, ``flatten(("DP", "CP"), "dp_cp")`` adds ``dp_cp`` of size 8:
        rank 5's group is ``[1, 3, 5, 7, 9, 11, 13, 15]`` and rank 4's ``[0, 2, ..., 14]``. The name
        defaults to the atoms joined by ``_``. Flattening the same dims under the same name again
        returns this layout.
        """
        return _flatten(self, dims, name)

    def flat_name(self, dims: Dims, name: str | None = None) -> str:
        """The name :meth:`flatten` gives ``dims``: ``name`` checked, or the atoms joined by ``_`` (``DP_TP``)."""
        return _flat_name(self, dims, name)

    def split(self, dim: str, names: Sequence[str], sizes: Sequence[int]) -> MeshLayout:
        """This layout with ``dim`` divided row-major into ``names`` of ``sizes``; ``dim`` keeps answering.

        * A mesh dim (or a part of an earlier split) is refined: on ``(DP=4, TP=2)``,
          ``split("DP", ("dp_replicate", "dp_shard"), (2, 2))`` gives mesh dims
          ``(dp_replicate, dp_shard, TP)``, and ``DP`` becomes a flattened dim over its parts
          (rank 5's DP group is still ``[1, 3, 5, 7]``, its index still 2).
        * A flattened dim gets a second factorization: on ``(DP=4, CP=2, TP=2)`` with
          ``dp_cp = DP x CP``, ``split("dp_cp", ("EDP", "EP"), (2, 4))`` adds the factorization
          ``(EDP, EP, TP)`` beside ``(DP, CP, TP)``; rank 5's EP group is ``[1, 3, 5, 7]`` and its
          EDP group ``[5, 13]``. Views take their dims from one factorization.
        """
        return _split(self, dim, names, sizes)

    # ------------------------------------------------ coordinate <-> global rank
    def check_rank(self, rank: int) -> int:
        """``rank``'s position in the mesh (``rank - first_rank``) if it is a member; ``TypeError`` if not an integer, else ``ValueError``."""
        value = as_index(rank, "a global rank")
        first = self.first_rank
        if not first <= value < first + self.world_size:
            raise ValueError(f"global rank {value} is out of range; valid: {first}..{first + self.world_size - 1}")
        return value - first

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Coordinate of global ``rank`` on the mesh dims: on (2, 4), rank 6 -> (1, 2) and rank 1 -> (0, 1)."""
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
            if not 0 <= c < size:
                raise ValueError(f"coordinate {given}: {name}={c!r} is out of range; valid: 0..{size - 1}")
        return self.first_rank + sum(c * st for c, st in zip(coordinate, self.strides))

    # ----------------------------------------------------------------- groups
    def group_size(self, dims: Dims, absent_ok: bool = False) -> int:
        """Number of ranks in every group along ``dims`` (1 for ``()``)."""
        return self._group(dims, absent_ok)[1].size

    def index_in_group(self, rank: int, dims: Dims, absent_ok: bool = False) -> int:
        """Position of ``rank`` inside its group along ``dims`` (row-major over ``dims``)."""
        return self._group(dims, absent_ok)[1].index(self.check_rank(rank))

    def member(self, rank: int, dims: Dims, index: int, absent_ok: bool = False) -> int:
        """Global rank of member ``index`` of ``rank``'s group along ``dims``."""
        names, group = self._group(dims, absent_ok)
        x = self.check_rank(rank)
        given, index = index, as_index(index, "a local rank")
        if not 0 <= index < group.size:
            raise ValueError(
                f"local rank {given!r} is out of range along {'x'.join(names) or '(none)'} (size {group.size}); "
                f"valid: 0..{group.size - 1}"
            )
        return self.first_rank + group.place(group.base(x), index)

    def group_ranks(self, rank: int, dims: Dims, absent_ok: bool = False) -> list[int]:
        """Every global rank in ``rank``'s group along ``dims``, in member order."""
        group = self._group(dims, absent_ok)[1]
        base = self.first_rank + group.base(self.check_rank(rank))
        return [base + o for o in group.offsets()]

    def group_index(self, rank: int, dims: Dims, absent_ok: bool = False) -> int:
        """Which group along ``dims`` holds ``rank``, counting groups as :meth:`all_groups` lists them."""
        return self._group(dims, absent_ok)[1].which(self.check_rank(rank))

    def all_groups(self, dims: Dims) -> list[list[int]]:
        """The world partitioned into groups along ``dims``, ordered row-major over the other axes.

        On (2, 4) with names (DP, TP): ``all_groups("TP")`` is ``[[0, 1, 2, 3], [4, 5, 6, 7]]`` and
        ``all_groups("DP")`` is ``[[0, 4], [1, 5], [2, 6], [3, 7]]``.
        """
        group = self._group(dims)[1]
        offsets = group.offsets()
        return [[self.first_rank + b + o for o in offsets] for b in group.firsts()]

    def group_at(self, dims: Dims, index: int) -> list[int]:
        """Group number ``index`` along ``dims``: ``all_groups(dims)[index]`` without building the rest."""
        group = self._group(dims)[1]
        index = as_index(index, "a group index")
        if not 0 <= index < group.count:
            raise ValueError(f"group index {index!r} is out of range; valid: 0..{group.count - 1}")
        base = self.first_rank + group.first_of(index)
        return [base + o for o in group.offsets()]

    def neighbor(self, rank: int, dims: Dims, offset: int = 1, wrap: bool = False, absent_ok: bool = False) -> int | None:
        """The global rank ``offset`` steps from ``rank`` along ``dims``, or None past an edge.

        On (PP=4, TP=2): ``neighbor(3, "PP", +1)`` is 5; ``neighbor(7, "PP", +1)`` is None,
        and 1 with ``wrap=True``.
        """
        group = self._group(dims, absent_ok)[1]
        x = self.check_rank(rank)
        target = group.index(x) + offset
        if wrap:
            target %= group.size
        elif not 0 <= target < group.size:
            return None
        return self.first_rank + group.place(group.base(x), target)
