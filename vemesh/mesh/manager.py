"""``VeDeviceMesh``: one global torch ``DeviceMesh`` that answers for every rank.

All examples below use this mesh, built on 8 ranks::

    VESCALE_DEVICE_MESH.init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("PP", "DP", "TP"))

    rank:  0 1 2 3 4 5 6 7
    PP:    0 0 0 0 1 1 1 1
    DP:    0 0 1 1 0 0 1 1
    TP:    0 1 0 1 0 1 0 1

Every question is answered by the mesh's :class:`~vemesh.layout.MeshLayout`, which owns
every name: mesh dims, flattened dims (:meth:`VeDeviceMesh.flatten`) and split parts
(:meth:`VeDeviceMesh.split`). A name, once the mesh has it, always answers as itself.
Questions about *strategies* (``get_strategy_size``, ``lookup_rank``, ``to_global_rank``,
``to_local_rank``, ``get_neighbor_rank``, ``get_optional_mesh``) treat the standard names
``PP, DP, TP, CP, EP`` that the mesh never had as size 1, so ``get_strategy_size("CP") > 1``
works on any mesh, unless the mesh spells the name another way (``dp``, ``dp_shard``:
:func:`vemesh.layout.names.other_spellings`); then they raise ``KeyError`` naming it. Questions about
*structure* (``size``, ``mesh["CP"]``, ``get_group``) raise ``KeyError`` for a name the mesh lacks.

This class holds the queries and a cache of torch views; start-up lives in :func:`vemesh.mesh.startup.build_mesh`,
veScale's method names in :mod:`vemesh.mesh.vescale_names`. The fault-tolerant replica dim (:mod:`vemesh.ft`) holds
the mesh and answers for its own name; the mesh only reserves the name (:meth:`VeDeviceMesh.reserve`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vemesh.mesh.vescale_names import VeScaleAliases
from vemesh.layout.mesh_layout import Dims, MeshLayout, as_index
from vemesh.mesh.startup import apply_timeout, build_mesh
from vemesh.mesh.debug import MeshDebug
from vemesh.mesh.views import MeshViews

__all__ = ["VeDeviceMesh", "VESCALE_DEVICE_MESH"]

_logger = logging.getLogger("vemesh")

_NOT_INITIALIZED = (
    "the device mesh is not initialized; call "
    "VESCALE_DEVICE_MESH.init_device_mesh(device_type, mesh_shape, mesh_dim_names=...) first"
)


class VeDeviceMesh(MeshViews, MeshDebug, VeScaleAliases):
    """A manager for one global torch ``DeviceMesh`` plus rank arithmetic for any rank.

    ``VESCALE_DEVICE_MESH`` is the process-wide instance; ``VeDeviceMesh()``
    builds an independent one (handy in tests). All state lives on the
    instance; :meth:`reset` drops it.
    """

    def __init__(self) -> None:
        self._mesh: DeviceMesh | None = None
        self._layout: MeshLayout | None = None
        self._rank = -1
        self._coordinate: tuple[int, ...] = ()
        self._member = False  # whether this rank is in the mesh (a mesh may cover part of the world)
        self._timeout: timedelta | None = None  # given to every group this mesh creates
        self._dim_meshes: dict[str, DeviceMesh] = {}  # name -> its 1-D torch mesh, with its process group
        self._views: dict[Any, DeviceMesh] = {}  # key as the user wrote it, or resolved names -> view
        self._submeshes: dict[tuple[tuple[str, ...], int], DeviceMesh] = {}
        self._epoch = 0  # one more at every reset(): views of an older epoch are refused by the wrappers

    # ================================================================ set-up
    def init_device_mesh(
        self,
        device_type: str,
        mesh_shape: Sequence[int],
        *,
        mesh_dim_names: Sequence[str] | None = None,
        check_uniqueness: bool = False,
        log_layout: bool | None = None,
        timeout: timedelta | float | None = None,
        backend_override: Mapping[str | int, Any] | None = None,
        rank_offset: int | None = None,
        hang_dir: str | os.PathLike | None = None,
    ) -> DeviceMesh:
        """Build the global mesh (and the default process group if there is none).

        Args:
            device_type: ``"cpu"``, ``"cuda"``, ... (``"cuda:0"`` becomes ``"cuda"`` with a warning).
            mesh_shape: size per dim, outermost first; one size may be ``-1`` (inferred).
                The product must equal the world size.
            mesh_dim_names: one name per dim. Defaults: 1-D ``("DP",)``, 2-D ``("DP", "TP")``,
                3-D ``("PP", "DP", "TP")``; 4-D and more must be named.
            check_uniqueness: raise ``RuntimeError`` instead of replacing an existing mesh.
            log_layout: rank 0 logs :meth:`describe` (and layout warnings, such as a TP group
                spanning hosts) to the ``vemesh`` logger. Defaults to ``VEMESH_LOG_LAYOUT=1``.
            timeout: how long the start-up rendezvous and every collective of the mesh's groups
                wait for the other ranks (a ``timedelta`` or seconds). Default: 10 minutes when
                vemesh creates the process group; an existing group keeps its own.
            rank_offset: build the mesh over the ranks from this global rank on (``(2, 2)`` with
                ``rank_offset=4`` is ranks 4..7 of 8), e.g. one model of two on one job. Every rank
                of the world must make the call; ranks outside get a clear error when they ask
                about their own place, and rank-agnostic queries answer in global ranks. Hold a
                second such mesh in another ``VeDeviceMesh()``.
            backend_override: per dim (name or index), a backend name, process-group options,
                or ``(backend, options)``, passed to torch's ``init_device_mesh``. A dim given
                options keeps their timeout.
            hang_dir: watch for hangs (default: ``VEMESH_HANG_DIR``): torch's Flight Recorder on, and a
                collective waiting ``VEMESH_HANG_AFTER`` s (default half of ``timeout``) makes every rank dump
                to this directory and the job end with the diagnosis (:mod:`vemesh.hangs`; ``vemesh diagnose``).

        Returns:
            The torch ``DeviceMesh``; on 8 ranks with shape ``(2, -1, 2)`` every rank gets
            ``DeviceMesh((PP=2, DP=2, TP=2), ...)``.

        Under torchrun the process group comes from its environment; a plain
        ``python script.py`` gets a one-rank group. Every rank must pass the
        same arguments: on a real backend a mismatch raises ``ValueError`` on
        every rank instead of hanging in group creation.
        """
        if check_uniqueness and self._mesh is not None:
            raise RuntimeError(
                f"the device mesh is already initialized as {self!r}; call reset() first "
                "or pass check_uniqueness=False to replace it"
            )
        hang_dir = self._hang_dir(hang_dir)
        mesh, layout, group_timeout = build_mesh(
            device_type, mesh_shape, mesh_dim_names, timeout, backend_override, rank_offset
        )
        self.reset()
        self._mesh, self._timeout, self._rank = mesh, group_timeout, dist.get_rank()
        self._set_layout(layout)
        self._stamp(mesh)
        if log_layout is None:
            log_layout = os.environ.get("VEMESH_LOG_LAYOUT", "0") not in ("", "0")
        if log_layout and self._rank == 0:
            self._log_layout()
        self._watch_hangs(hang_dir)  # after the layout: the dumps describe the mesh
        return mesh

    def flatten(self, dims: Dims, name: str | None = None) -> DeviceMesh:
        """Merge dims (given in mesh order) into one 1-D dim with its own process group.

        ``flatten(("DP", "TP"))`` makes ``"DP_TP"``: ``DeviceMesh([4, 5, 6, 7])`` on rank 5 and
        ``[0, 1, 2, 3]`` on rank 1, reachable afterwards as ``VESCALE_DEVICE_MESH["DP_TP"]``
        and usable by every query. Flattening again with the same name returns the same mesh.
        The dims may themselves be flattened or split ones (torchtitan's ``dp_cp`` from
        ``dp_replicate`` and ``dp_shard_cp``), as long as they run in mesh order. Every rank
        must call it (it creates a process group).
        """
        layout = self.layout
        flat = layout.flatten(dims, name)
        name = layout.flat_name(dims, name)
        if flat is not layout:
            mesh = self._torch_view(layout.resolve((dims,) if isinstance(dims, (str, int)) else dims))._flatten(name)
            self._track([mesh.get_group()])
            self._dim_meshes[name] = self._stamp(mesh)
            self._set_layout(flat)
        return self._dim_mesh(name)

    def split(self, dim: str, names: Sequence[str], sizes: Sequence[int]) -> DeviceMesh:
        """Divide a dim into several with torch's ``_unflatten``; ``dim`` keeps answering as before.

        On ``(DP, TP) = (4, 2)``, ``split("DP", ("dp_replicate", "dp_shard"), (2, 2))`` makes the
        mesh ``(dp_replicate, dp_shard, TP) = (2, 2, 2)``: rank 5 is then in ``dp_shard`` group
        ``[5, 7]`` and ``dp_replicate`` group ``[1, 5]``, exactly the groups of a mesh built
        ``(2, 2, 2)`` from the start. ``DP`` is now a flattened dim over the parts: its size (4),
        ``lookup_rank("DP")`` (2 on rank 5), its group and ``mesh["DP"]`` are what they were.

        Splitting a flattened dim gives a second factorization of the same ranks (MoE's expert
        layout): on 16 ranks ``(DP, CP, TP) = (4, 2, 2)``, ``flatten(("DP", "CP"), "dp_cp")`` then
        ``split("dp_cp", ("EDP", "EP"), (2, 4))`` gives EP groups of 4 (``[1, 3, 5, 7]`` on rank 5)
        and EDP groups of 2 (``[5, 13]``), beside the dense dims; views take their dims from one
        factorization. Every rank must call it (it creates process groups).

        Returns:
            The torch mesh of the new dims: ``DeviceMesh([[1, 5], [3, 7]])`` with dims
            ``("dp_replicate", "dp_shard")`` on rank 5 for the first example.
        """
        layout = self.layout
        new = layout.split(dim, names, sizes)
        names, sizes = tuple(names), tuple(sizes)
        if dim in layout.dim_names:  # the torch mesh itself gets the finer dims
            self._dim_mesh(dim)  # keep the dim's own 1-D mesh and group: it answers for the name from now on
            unflat = self.mesh._unflatten(layout.dim_index(dim), sizes, names)
            self._mesh = unflat
        else:
            unflat = self._dim_mesh(dim)._unflatten(0, sizes, names)
        parts = {n: self._stamp(unflat[n]) for n in names}
        self._track([m.get_group() for m in parts.values()])
        self._dim_meshes.update(parts)
        self._set_layout(new)
        return self._torch_view(names)

    def reserve(self, name: str) -> None:
        """Keep ``name`` for a dim that lives outside this mesh, until :meth:`reset` or the next init.

        The fault-tolerant replica dim of :func:`vemesh.ft.start_replicas` is one: other jobs, outside this world,
        whose membership torchft decides every step. The :class:`vemesh.ft.Replicas` answer for it; the mesh holds
        only the name, so that every query of it (size, rank, group, view, flatten) raises saying so.
        """
        self._set_layout(self.layout.with_managed(name))

    def get(self, **kwargs: Any) -> DeviceMesh:
        """The global torch mesh, initialized from ``kwargs`` on the first call (``get()`` before init raises)."""
        if self._mesh is None:
            if not kwargs:
                raise RuntimeError(_NOT_INITIALIZED)
            return self.init_device_mesh(**kwargs)
        return self._mesh

    def is_initialized(self) -> bool:
        """Whether :meth:`init_device_mesh` has run (and :meth:`reset` has not since)."""
        return self._mesh is not None

    @property
    def epoch(self) -> int:
        """How many times this mesh was reset (``init_device_mesh`` resets too): views carry the epoch they came from."""
        return self._epoch

    def is_member(self) -> bool:
        """Whether this rank is in the mesh (False on ranks outside a mesh built with ``rank_offset``)."""
        return self._member

    def reset(self) -> None:
        """Drop the global mesh and every cached view, flattened dim and submesh (torch keeps the process groups).

        Views handed out before are stale from now on: vemesh's wrappers refuse them (take them again after init).
        """
        self._mesh, self._layout, self._rank, self._coordinate, self._member = None, None, -1, (), False
        self._timeout = None
        self._dim_meshes, self._views, self._submeshes = {}, {}, {}
        self._epoch += 1

    # ============================================================= the mesh
    @property
    def mesh(self) -> DeviceMesh:
        """The global torch ``DeviceMesh`` (the same on every rank)."""
        if self._mesh is None:
            raise RuntimeError(_NOT_INITIALIZED)
        return self._mesh

    @property
    def layout(self) -> MeshLayout:
        """The mesh as pure arithmetic, with every name (:class:`~vemesh.layout.MeshLayout`)."""
        if self._layout is None:
            raise RuntimeError(_NOT_INITIALIZED)
        return self._layout

    @property
    def device_type(self) -> str:
        return self.mesh.device_type

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

    def size(self, dim: Dims | None = None) -> int:
        """World size, or the size of a dim: ``size("TP")`` is 2 on every rank; an absent name raises ``KeyError``."""
        if dim is None:
            return self.layout.world_size
        return self.layout.group_size(dim)

    def get_coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate: ``(0, 1, 1)`` on rank 3, ``(1, 0, 1)`` on rank 5."""
        self._my_rank()
        return self._coordinate

    # ======================================================== rank arithmetic
    def get_strategy_size(self, dim: Dims) -> int:
        """Size of a strategy: ``"TP"`` gives 2; ``"CP"``, absent, gives 1; ``"Tp"``, and ``"DP"`` on ``("dp", "tp")``, raise."""
        return self.layout.group_size(dim, absent_ok=True)

    def get_strategy_coordinate(self, rank: int | None = None) -> list[int]:
        """Coordinate of this rank (rank 6 gets ``[1, 1, 0]``) or of any global ``rank``.

        ``get_strategy_coordinate(5)`` is ``[1, 0, 1]`` whichever rank asks.
        """
        if rank is None:
            self._my_rank()
            return list(self._coordinate)
        return list(self.layout.coordinate(rank))

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
            rank = self._my_rank()  # missing dims keep this rank's place
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
        return self.layout.index_in_group(self._my_rank(), dim, absent_ok=True)

    def get_local_rank(self, dim: Dims | None = None) -> int:
        """This rank's index along ``dim`` (torch's meaning), or without ``dim``, its index on its host.

        ``get_local_rank("TP")`` is what torch's ``mesh.get_local_rank("TP")`` gives: 1 on
        rank 5; a name the mesh does not have raises ``KeyError``, as in torch.

        ``get_local_rank()`` is torchrun's ``LOCAL_RANK`` (else ``rank % LOCAL_WORLD_SIZE``, else the global
        rank): with 4 devices per host rank 5 gets 1. Unlike veScale, no coordinate is found from it.
        """
        rank = self._my_rank()
        if dim is not None:
            return self.layout.index_in_group(rank, dim)
        if "LOCAL_RANK" in os.environ:
            return int(os.environ["LOCAL_RANK"])
        if "LOCAL_WORLD_SIZE" in os.environ:
            return rank % int(os.environ["LOCAL_WORLD_SIZE"])
        return rank

    def to_global_rank(self, local_rank: int, dim: Dims) -> int:
        """Global rank of member ``local_rank`` of this rank's group along ``dim``.

        ``to_global_rank(1, "PP")`` is 5 on rank 1 and 7 on rank 3; ``to_global_rank(0, "TP")``
        is 4 on rank 5. A ``local_rank`` outside ``0..size-1`` raises ``ValueError``.
        """
        return self.layout.member(self._my_rank(), dim, local_rank, absent_ok=True)

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
        return self.layout.neighbor(self._my_rank(), dim, offset, wrap, absent_ok=True)

    def __repr__(self) -> str:
        if self._layout is None:
            return "VeDeviceMesh(uninitialized)"
        dims = ", ".join(f"{n}={s}" for n, s in zip(self._layout.dim_names, self._layout.shape))
        where = f"coordinate={self._coordinate}" if self._member else "not a member"
        return f"VeDeviceMesh(({dims}), device_type={self.device_type!r}, rank={self._rank}, {where})"

    # ============================================================== helpers
    def _set_layout(self, layout: MeshLayout) -> None:
        """Adopt ``layout`` (after init, a flatten or a split); views are rebuilt from the 1-D meshes on demand."""
        self._layout = layout
        self._member = layout.first_rank <= self._rank < layout.first_rank + layout.world_size
        self._coordinate = layout.coordinate(self._rank) if self._member else ()
        self._views, self._submeshes = {}, {}

    def _track(self, groups: list[dist.ProcessGroup]) -> None:
        """Give groups this mesh created after init the mesh's timeout."""
        if self._timeout is not None and dist.get_backend() != "fake":
            apply_timeout([g for g in groups if g is not None], self._timeout)

    def _my_rank(self) -> int:
        if self._mesh is None:
            raise RuntimeError(_NOT_INITIALIZED)
        if not self._member:
            first, n = self.layout.first_rank, self.layout.world_size
            raise RuntimeError(
                f"global rank {self._rank} is not in this mesh, which covers global ranks {first}..{first + n - 1}; "
                "only its members can ask about their own place in it (rank-agnostic queries such as "
                "get_strategy_coordinate(r) or get_submeshes(dim) work on every rank)"
            )
        return self._rank


#: The process-wide mesh manager.
VESCALE_DEVICE_MESH = VeDeviceMesh()
