"""Layout algebra: ``flatten`` and ``split`` of a :class:`~vemesh.layout.MeshLayout`, each returning a new layout.

The bodies of :meth:`MeshLayout.flatten <vemesh.layout.MeshLayout.flatten>` and
:meth:`MeshLayout.split <vemesh.layout.MeshLayout.split>`, kept apart so the layout
module reads as queries. Pure: no process group, no torch.

* ``flatten`` adds a merged name: its axes are the merged dims' axes, coalesced.
* ``split`` of an *atom* (a mesh dim, or a part of an earlier split) refines every
  factorization that holds it; the atom stays as a merged name over its parts, so it
  answers exactly as before.
* ``split`` of a *merged* name adds a factorization: the parts replace the merged dims
  in the factorization where those dims are adjacent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from vemesh.layout.axes import NamedDim, coalesce, divide
from vemesh.layout.names import as_index, check_dim_names

# A vemesh.layout.MeshLayout and its Dims: that module imports this one, so they are not imported here.
MeshLayout = Any
Dims = Any

__all__ = ["flat_name", "flatten", "split"]


def flat_name(layout: MeshLayout, dims: Dims, name: str | None = None) -> str:
    """``name`` checked, or the atoms of ``dims`` joined by ``_``: ``("DP", "TP")`` gives ``DP_TP``."""
    if name is None:
        names = layout.resolve((dims,) if isinstance(dims, (str, int)) else dims)
        name = "_".join(a for n in names for a in layout.named(n).parts)
    return check_dim_names((name,))[0]


def flatten(layout: MeshLayout, dims: Dims, name: str | None = None) -> MeshLayout:
    """``layout`` plus a merged name over ``dims``; ``layout`` itself if that name already merges them."""
    if isinstance(dims, (str, int)):
        dims = (dims,)
    names = layout.resolve(dims)
    if not names:
        raise ValueError("flatten needs at least one dim; got none")
    atoms = tuple(a for n in names for a in layout.named(n).parts)
    name = flat_name(layout, dims, name)
    if name in layout.managed:
        raise ValueError(f"flattened name {name!r} is the mesh's fault-tolerant replica dim; pick another")
    if layout.has(name):
        existing = layout.named(name)
        if existing.is_atom:
            raise ValueError(f"flattened name {name!r} is already a dim of {layout.names}; pick another")
        if existing.parts != atoms:
            raise ValueError(f"{name!r} already names the flattened dims {existing.parts}, not {atoms}; pick another")
        return layout
    axes = coalesce(tuple(m for n in names for m in layout.named(n).axes))
    size = math.prod(layout.named(n).size for n in names)
    return replace(layout, extra_dims=(*layout.extra_dims, NamedDim(name, size, axes, atoms, names)))


def split(layout: MeshLayout, dim: str, names: Sequence[str], sizes: Sequence[int]) -> MeshLayout:
    """``layout`` with ``dim`` divided row-major into ``names`` of ``sizes`` (see :meth:`MeshLayout.split`)."""
    target = layout.named(dim)
    names = check_dim_names(names)
    sizes = tuple(as_index(s, "a split size") for s in sizes)
    if len(names) != len(sizes) or len(names) < 2:
        raise ValueError(f"split needs two or more names and one size per name; got names {names} and sizes {sizes}")
    clash = [n for n in names if layout.has(n) or n in layout.managed]
    if clash:
        raise ValueError(f"split names {clash} are already dims of this mesh {layout.names}; pick others")
    if any(s < 1 for s in sizes) or math.prod(sizes) != target.size:
        raise ValueError(
            f"split sizes {sizes} multiply to {math.prod(sizes)}, but dim {dim!r} has size {target.size}; "
            f"they must multiply to {target.size}"
        )
    axes = divide(target.axes, sizes)
    if axes is None:
        raise ValueError(
            f"cannot split {layout.spell(dim)} into sizes {sizes}: a part would not be one stride pattern over "
            f"its ranks (the sizes must fall on the boundaries of {', '.join(target.parts)})"
        )
    parts = tuple(NamedDim(n, s, m, (n,)) for n, s, m in zip(names, sizes, axes))
    if target.is_atom:
        return _refine(layout, target, parts)
    home = next((f for f in layout.factorizations if _run(f, target.parts) is not None), None)
    if home is None:
        raise ValueError(
            f"cannot split {layout.spell(dim)}: its dims are not adjacent in any factorization "
            f"{list(layout.factorizations)}, so the parts would have no place in one"
        )
    start = _run(home, target.parts)
    assert start is not None
    atoms = (*home[:start], *names, *home[start + len(target.parts):])
    return replace(layout, extra_dims=(*layout.extra_dims, *parts),
                   extra_factorizations=(*layout.extra_factorizations, atoms))


def _refine(layout: MeshLayout, target: NamedDim, parts: tuple[NamedDim, ...]) -> MeshLayout:
    """Replace the atom ``target`` by ``parts`` everywhere; ``target`` stays, as a merged name over them."""
    names = tuple(p.name for p in parts)

    def splice(atoms: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n for a in atoms for n in (names if a == target.name else (a,)))

    extra = tuple(replace(d, parts=splice(d.parts)) for d in layout.extra_dims if d.name != target.name)
    shape, dim_names = layout.shape, layout.dim_names
    if target.name in dim_names:  # the mesh dims themselves get finer: the parts are mesh dims
        i = dim_names.index(target.name)
        shape = (*shape[:i], *(p.size for p in parts), *shape[i + 1:])
        dim_names = splice(dim_names)
    else:
        extra = (*extra, *parts)
    merged = NamedDim(target.name, target.size, target.axes, names, names)
    out = type(layout)(shape, dim_names, layout.first_rank, (*extra, merged),
                       tuple(map(splice, layout.extra_factorizations)), layout.managed)
    assert all(out.named(p.name).axes == p.axes for p in parts)
    return out


def _run(atoms: tuple[str, ...], run: tuple[str, ...]) -> int | None:
    """Where ``run`` starts as a contiguous run inside ``atoms``, or None."""
    for i in range(len(atoms) - len(run) + 1):
        if atoms[i:i + len(run)] == run:
            return i
    return None
