"""Rank arithmetic of :class:`~vemesh.VeDeviceMesh`, for this rank and any other, over two public answers only.

:class:`LayoutQueries` asks its mesh for ``layout`` (the :class:`~vemesh.layout.MeshLayout`, owner of every name)
and ``get_rank()`` (this rank, or the error of a rank outside the mesh): every answer is the layout's arithmetic.
It holds no state and reads no private attribute, so it composes with any object that gives those two.
See :mod:`vemesh.mesh.manager` for the 8-rank mesh the examples use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from vemesh.layout.mesh_layout import Dims, as_index

if TYPE_CHECKING:
    from vemesh.layout.mesh_layout import MeshLayout

__all__ = ["LayoutQueries", "torch_dim"]


def torch_dim(dim: Dims | None, mesh_dim: Dims | None, method: str) -> Dims | None:
    """The dim a query was given, as vemesh names it (``dim``) or as torch's ``DeviceMesh`` does (``mesh_dim=``,
    which torch's own code passes by keyword: ``mesh.size(mesh_dim=0)``); both at once is a ``TypeError``."""
    if mesh_dim is None:
        return dim
    if dim is not None:
        raise TypeError(f"{method}() got the dim twice: {dim!r} and mesh_dim={mesh_dim!r} (mesh_dim is torch's name "
                        "for the same argument); give one")
    return mesh_dim


class LayoutQueries:
    """Sizes, coordinates and ranks by name: the layout's answers for this rank (``get_rank()``) or any rank."""

    layout: MeshLayout

    def get_rank(self) -> int:  # pragma: no cover - the mesh gives it
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes per dim: ``(2, 2, 2)`` on every rank of the example mesh."""
        return self.layout.shape

    @property
    def ndim(self) -> int:
        return self.layout.ndim

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """``("PP", "DP", "TP")`` on every rank of the example mesh."""
        return self.layout.dim_names

    def size(self, dim: Dims | None = None, *, mesh_dim: Dims | None = None) -> int:
        """World size, or the size of a dim: ``size("TP")`` is 2 on every rank; an absent name raises ``KeyError``.

        ``mesh_dim=`` is torch's name for ``dim`` (``DeviceMesh.size(mesh_dim=1)``), taken as well."""
        dim = torch_dim(dim, mesh_dim, "size")
        if dim is None:
            return self.layout.world_size
        return self.layout.group_size(dim)

    def get_coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate: ``(0, 1, 1)`` on rank 3, ``(1, 0, 1)`` on rank 5."""
        return self.layout.coordinate(self.get_rank())

    # ======================================================== rank arithmetic
    def get_strategy_size(self, dim: Dims) -> int:
        """Size of a strategy: ``"TP"`` gives 2; ``"CP"``, absent, gives 1; ``"Tp"``, and ``"DP"`` on ``("dp", "tp")``, raise."""
        return self.layout.group_size(dim, absent_ok=True)

    def get_strategy_coordinate(self, rank: int | None = None) -> list[int]:
        """Coordinate of this rank (rank 6 gets ``[1, 1, 0]``) or of any global ``rank``.

        ``get_strategy_coordinate(5)`` is ``[1, 0, 1]`` whichever rank asks.
        """
        return list(self.layout.coordinate(self.get_rank() if rank is None else rank))

    def get_global_rank(self, coordinate: Sequence[int] | Mapping[Dims, int]) -> int:
        """Global rank at a coordinate: the inverse of :meth:`get_strategy_coordinate`.

        Args:
            coordinate: a full coordinate (``[1, 0, 1]`` -> 5 on every rank), or a mapping
                by name (any name: a mesh dim, a flattened or a split one) whose missing dims
                keep this rank's place: ``{"PP": 1}`` is this rank's counterpart in stage 1
                (rank 2 gets 6, rank 3 gets 7).
        """
        layout = self.layout
        if type(coordinate) is tuple or type(coordinate) is list:
            return layout.rank(coordinate)
        if isinstance(coordinate, Mapping):
            rank = self.get_rank()  # missing dims keep this rank's place
            for dim, index in coordinate.items():
                size = layout.group_size(dim)
                index = as_index(index, f"coordinate entry {dim!r}")
                if not 0 <= index < size:
                    raise ValueError(f"coordinate {dict(coordinate)}: {dim}={index} is out of range; valid: 0..{size - 1}")
                rank = layout.member(rank, dim, index)
            return rank
        return layout.rank(coordinate)  # checks it is a sequence of integers

    def lookup_rank(self, dim: Dims) -> int:
        """This rank's index along ``dim``: ``lookup_rank("DP")`` is 1 on ranks 2, 3, 6, 7 and 0 elsewhere."""
        return self.layout.index_in_group(self.get_rank(), dim, absent_ok=True)

    def get_local_rank(self, dim: Dims | None = None, *, mesh_dim: Dims | None = None) -> int:
        """This rank's index along ``dim``, as torch's ``DeviceMesh.get_local_rank`` answers.

        ``get_local_rank("TP")`` is what torch's ``mesh.get_local_rank("TP")`` gives: 1 on rank 5; a name the mesh
        does not have raises ``KeyError``, as in torch. ``mesh_dim=`` is torch's name for ``dim``, taken as well.
        Without ``dim``, as in torch: the index along a 1-D mesh's only dim, and on a mesh of more dims a
        ``RuntimeError`` naming them. The index on the host (veScale's ``get_local_rank()``, the device to use) is
        torchrun's ``int(os.environ["LOCAL_RANK"])``, not a mesh query: on a 1-D mesh over two hosts of 4 devices,
        rank 5's index is 5 and its host's is 1.
        """
        dim = torch_dim(dim, mesh_dim, "get_local_rank")
        if dim is None:
            names = self.layout.dim_names
            if len(names) > 1:
                raise RuntimeError(f"get_local_rank() needs a dim on a mesh of {len(names)} dims {names}, as torch's "
                                   f"DeviceMesh does: get_local_rank({names[-1]!r}) is this rank's index along "
                                   f"{names[-1]}; this rank's index on its host (the device to use) is torchrun's "
                                   'int(os.environ["LOCAL_RANK"])')
            dim = names[0]
        return self.layout.index_in_group(self.get_rank(), dim)

    def to_global_rank(self, local_rank: int, dim: Dims) -> int:
        """Global rank of member ``local_rank`` of this rank's group along ``dim``.

        ``to_global_rank(1, "PP")`` is 5 on rank 1 and 7 on rank 3; ``to_global_rank(0, "TP")``
        is 4 on rank 5. A ``local_rank`` outside ``0..size-1`` raises ``ValueError``.
        """
        return self.layout.member(self.get_rank(), dim, local_rank, absent_ok=True)

    def to_local_rank(self, global_rank: int, dim: Dims) -> int:
        """Index of any ``global_rank`` inside its own group along ``dim``.

        ``to_local_rank(6, "DP")`` is 1 and ``to_local_rank(6, "TP")`` is 0 on every rank.
        """
        return self.layout.index_in_group(global_rank, dim, absent_ok=True)

    def get_neighbor_rank(self, dim: Dims, offset: int = 1, wrap: bool = False) -> int | None:
        """Global rank ``offset`` steps along ``dim`` from this rank, or None past the edge.

        ``get_neighbor_rank("PP")`` is 4 on rank 0 and None on rank 4 (4 gets 0 with
        ``wrap=True``); ``get_neighbor_rank("PP", -1)`` is 1 on rank 5.
        """
        offset = as_index(offset, "a neighbor offset")
        if not isinstance(wrap, bool):
            raise TypeError(f"wrap must be True or False; got {wrap!r}")
        return self.layout.neighbor(self.get_rank(), dim, offset, wrap, absent_ok=True)
