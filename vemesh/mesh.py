"""``VeDeviceMesh``: one global torch ``DeviceMesh`` that answers for every rank.

All examples below use this mesh, built on 8 ranks::

    VESCALE_DEVICE_MESH.init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("PP", "DP", "TP"))

    rank:  0 1 2 3 4 5 6 7
    PP:    0 0 0 0 1 1 1 1
    DP:    0 0 1 1 0 0 1 1
    TP:    0 1 0 1 0 1 0 1

Queries take a dim by name (``"TP"``), by index (outermost is 0), or, where it
makes sense, a flattened name made by :meth:`VeDeviceMesh.flatten`. Questions
about *strategies* (``get_strategy_size``, ``lookup_rank``, ``to_global_rank``,
``to_local_rank``, ``get_neighbor_rank``) treat the standard names ``PP, DP,
TP, CP, EP`` that the mesh lacks as size 1, so ``get_strategy_size("CP") > 1``
works on any mesh. Questions about *structure* (``size``, ``mesh["CP"]``,
``get_group``) raise ``KeyError`` for a name the mesh does not have.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh

from .layout import MeshLayout, as_index, check_dim_names, unknown_name_error
from .process_group import apply_timeout, as_timeout, check_same_on_all_ranks, ensure_process_group
from .spec import STANDARD_STRATEGIES, MeshSpec

__all__ = ["VeDeviceMesh", "VESCALE_DEVICE_MESH"]

_logger = logging.getLogger("vemesh")

#: A dim: its name, its index, or several of them for a multi-dim view.
Dim = Union[str, int]
Dims = Union[str, int, Sequence[Union[str, int]]]

_NOT_INITIALIZED = (
    "the device mesh is not initialized; call "
    "VESCALE_DEVICE_MESH.init_device_mesh(device_type, mesh_shape, mesh_dim_names=...) first"
)


class VeDeviceMesh:
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
        self._dims: dict[str, tuple[int, ...]] = {}  # dim name or flattened name -> dims
        self._views: dict[Any, DeviceMesh] = {}  # key as the user wrote it -> view
        self._submeshes: dict[tuple[tuple[int, ...], int], DeviceMesh] = {}
        self._timeout: timedelta | None = None  # given to every group this mesh creates
        self._member = False  # whether this rank is in the mesh (a mesh may cover part of the world)

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
        spec = MeshSpec(
            device_type=device_type,
            mesh_shape=mesh_shape,  # type: ignore[arg-type]
            mesh_dim_names=mesh_dim_names,  # type: ignore[arg-type]
        )
        if str(device_type) != spec.device_type:  # "cuda:0" or torch.device("cuda", 0)
            warnings.warn(
                f"device_type {str(device_type)!r} names one device, but a mesh spans all of them: "
                f"using {spec.device_type!r} (select this rank's device before init instead)",
                UserWarning,
                stacklevel=2,
            )
        wait = as_timeout(timeout)
        fake = dist.is_initialized() and dist.get_backend() == "fake"  # torch's fake backend takes any device
        if spec.device_type != "cpu" and not fake:
            module = getattr(torch, spec.device_type, None)
            if module is None or not module.is_available():
                raise RuntimeError(
                    f"device_type {spec.device_type!r}: this machine has no {spec.device_type} device (torch "
                    f"{torch.__version__}); use 'cpu' to run on the CPU with gloo"
                )
        created = ensure_process_group(spec.device_type, wait)
        layout = spec.resolve(dist.get_world_size(), rank_offset)
        check_same_on_all_ranks(spec.device_type, layout)
        self.reset()
        override = self._check_backend_override(backend_override, layout)
        if layout.first_rank == 0 and layout.world_size == dist.get_world_size():
            mesh = _torch_init_device_mesh(
                spec.device_type, layout.shape, mesh_dim_names=layout.dim_names, backend_override=override
            )
        else:  # part of the world: every rank builds it (group creation is collective), members use it
            ranks = torch.arange(layout.first_rank, layout.first_rank + layout.world_size).view(layout.shape)
            mesh = DeviceMesh(spec.device_type, ranks, mesh_dim_names=layout.dim_names,
                              backend_override=tuple(self._override_tuple(override, layout)))
        self._timeout = wait if (created or timeout is not None) else None
        if self._timeout is not None and dist.get_backend() != "fake":
            keep = {layout.dim_index(k) for k, v in (override or {}).items() if not isinstance(v, str)}
            apply_timeout([mesh.get_group(d) for d in range(mesh.ndim) if d not in keep], self._timeout)
        self._mesh, self._layout, self._rank = mesh, layout, dist.get_rank()
        self._member = layout.first_rank <= self._rank < layout.first_rank + layout.world_size
        self._coordinate = layout.coordinate(self._rank) if self._member else ()
        self._dims = {name: (i,) for i, name in enumerate(layout.dim_names)}
        if self._member:
            self._views[layout.dim_names] = mesh
        if log_layout is None:
            log_layout = os.environ.get("VEMESH_LOG_LAYOUT", "0") not in ("", "0")
        if log_layout and self._rank == 0:
            self._log_layout()
        return mesh

    @staticmethod
    def _check_backend_override(override: Mapping[str | int, Any] | None, layout: MeshLayout) -> dict | None:
        """``backend_override`` checked against the mesh's dims (KeyError names the valid ones)."""
        if override is None:
            return None
        if not isinstance(override, Mapping):
            raise TypeError(f"backend_override must be a dict from dim name (or index) to a backend; got {override!r}")
        out = {}
        for key, value in override.items():
            layout.dim_index(key)  # KeyError naming the valid dims, or TypeError/ValueError for an index
            options_type = getattr(dist.ProcessGroup, "Options", None) or getattr(dist.Backend, "Options", ())
            ok = isinstance(value, str) or (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str))
            if not ok and not (options_type and isinstance(value, options_type)):
                raise TypeError(
                    f"backend_override[{key!r}] must be a backend name such as 'gloo', process-group options, "
                    f"or (backend, options); got {value!r}"
                )
            out[key] = value
        return out

    @staticmethod
    def _override_tuple(override: dict | None, layout: MeshLayout) -> Iterator[tuple[Any, Any]]:
        """``backend_override`` as the per-dim ``(backend, options)`` tuple that DeviceMesh takes."""
        for d in range(layout.ndim):
            value = next((v for k, v in (override or {}).items() if layout.dim_index(k) == d), None)
            yield (value, None) if isinstance(value, str) else (value if isinstance(value, tuple) else (None, value))

    def split(self, dim: str, names: Sequence[str], sizes: Sequence[int]) -> DeviceMesh:
        """Divide one dim into several, in place: the global mesh gains their names (torch's ``_unflatten``).

        On ``(DP, TP) = (4, 2)``, ``split("DP", ("dp_replicate", "dp_shard"), (2, 2))`` makes the
        mesh ``(dp_replicate, dp_shard, TP) = (2, 2, 2)``: rank 5 is then in ``dp_shard`` group
        ``[5, 7]`` and ``dp_replicate`` group ``[1, 5]``, exactly the groups of a mesh built
        ``(2, 2, 2)`` from the start. Flattened dims that included ``dim`` now cover its parts;
        their process groups are kept. Every rank must call it.

        Returns:
            The new global torch ``DeviceMesh``.
        """
        layout = self.layout
        if not isinstance(dim, str) or dim not in layout.dim_names:
            raise unknown_name_error("dim name", dim, layout.dim_names)
        names = check_dim_names(names)
        sizes = tuple(as_index(s, "a split size") for s in sizes)
        if len(names) != len(sizes) or len(names) < 2:
            raise ValueError(f"split needs two or more names and one size per name; got names {names} and sizes {sizes}")
        index = layout.dim_index(dim)
        clash = [n for n in names if n in self._dims and n != dim]
        if clash:
            raise ValueError(f"split names {clash} are already dims of this mesh {tuple(self._dims)}; pick others")
        if any(s < 1 for s in sizes) or math.prod(sizes) != layout.shape[index]:
            raise ValueError(
                f"split sizes {sizes} multiply to {math.prod(sizes)}, but dim {dim!r} has size {layout.shape[index]}; "
                f"they must multiply to {layout.shape[index]}"
            )
        mesh = self.mesh._unflatten(index, sizes, names)
        new_names = layout.dim_names[:index] + names + layout.dim_names[index + 1 :]
        new_shape = layout.shape[:index] + sizes + layout.shape[index + 1 :]
        grow = len(names) - 1

        def remap(d: int) -> tuple[int, ...]:
            return tuple(range(index, index + len(names))) if d == index else (d if d < index else d + grow,)

        flattened = {n: tuple(x for d in ds for x in remap(d)) for n, ds in self._dims.items() if n not in layout.dim_names}
        flat_views = {n: self._views[n] for n in flattened}
        self._mesh = mesh
        self._layout = MeshLayout(new_shape, new_names, first_rank=layout.first_rank)
        self._coordinate = self._layout.coordinate(self._rank) if self._member else ()
        self._dims = {name: (i,) for i, name in enumerate(new_names)} | flattened
        self._views = {new_names: mesh} | flat_views | {(n,): v for n, v in flat_views.items()}
        self._submeshes = {}
        if self._timeout is not None and dist.get_backend() != "fake":
            apply_timeout([mesh.get_group(d) for d in range(index, index + len(names))], self._timeout)
        return mesh

    def get(self, **kwargs: Any) -> DeviceMesh:
        """Return the global torch mesh, initializing it from ``kwargs`` if needed.

        ``get()`` before any init raises ``RuntimeError``; ``get(device_type="cpu",
        mesh_shape=(2, 2))`` initializes on first call and returns the same mesh afterwards.
        """
        if self._mesh is None:
            if not kwargs:
                raise RuntimeError(_NOT_INITIALIZED)
            return self.init_device_mesh(**kwargs)
        return self._mesh

    def is_initialized(self) -> bool:
        """Whether :meth:`init_device_mesh` has run (and :meth:`reset` has not since)."""
        return self._mesh is not None

    def reset(self) -> None:
        """Drop the global mesh and every cached view, flattened dim and submesh.

        The process groups themselves belong to torch and stay alive for
        anyone still holding them.
        """
        self._mesh, self._layout, self._rank, self._coordinate = None, None, -1, ()
        self._dims, self._views, self._submeshes = {}, {}, {}
        self._timeout = None

    # ============================================================= the mesh
    @property
    def mesh(self) -> DeviceMesh:
        """The global torch ``DeviceMesh`` (the same on every rank)."""
        if self._mesh is None:
            raise RuntimeError(_NOT_INITIALIZED)
        return self._mesh

    @property
    def layout(self) -> MeshLayout:
        """The mesh as pure arithmetic (:class:`~vemesh.layout.MeshLayout`)."""
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
        return self.layout.group_size(self._resolve(dim))

    def get_coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate: ``(0, 1, 1)`` on rank 3, ``(1, 0, 1)`` on rank 5."""
        self._my_rank()
        return self._coordinate

    # ======================================================== rank arithmetic
    def get_strategy_size(self, dim: Dims) -> int:
        """Size of a strategy: ``"TP"`` gives 2; ``"CP"``, absent, gives 1; ``"Tp"`` raises ``KeyError``."""
        return self.layout.group_size(self._resolve(dim, absent_ok=True))

    def get_strategy_coordinate(self, rank: int | None = None) -> list[int]:
        """Coordinate of this rank (rank 6 gets ``[1, 1, 0]``) or of any global ``rank``.

        ``get_strategy_coordinate(5)`` is ``[1, 0, 1]`` whichever rank asks.
        """
        layout = self._layout
        if layout is None:
            raise RuntimeError(_NOT_INITIALIZED)
        if rank is None:
            self._my_rank()
            return list(self._coordinate)
        return list(layout.coordinate(rank))

    def get_global_rank(self, coordinate: Sequence[int] | Mapping[Dim, int]) -> int:
        """Global rank at a coordinate: the inverse of :meth:`get_strategy_coordinate`.

        Args:
            coordinate: a full coordinate (``[1, 0, 1]`` -> 5 on every rank), or a
                mapping by dim whose missing dims keep this rank's coordinate:
                ``{"PP": 1}`` is this rank's counterpart in stage 1 (rank 2 gets 6, rank 3 gets 7).
        """
        layout = self._layout
        if layout is None:
            raise RuntimeError(_NOT_INITIALIZED)
        if type(coordinate) is tuple or type(coordinate) is list:
            return layout.rank(coordinate)
        if isinstance(coordinate, Mapping):
            self._my_rank()  # missing dims keep this rank's coordinate
            full = list(self._coordinate)
            for dim, index in coordinate.items():
                full[layout.dim_index(dim)] = as_index(index, f"coordinate entry {dim!r}")
            return layout.rank(full)
        return layout.rank(coordinate)  # checks it is a sequence of integers

    def lookup_rank(self, dim: Dims) -> int:
        """This rank's index along ``dim``: ``lookup_rank("DP")`` is 1 on ranks 2, 3, 6, 7 and 0 elsewhere."""
        return self.layout.index_in_group(self._my_rank(), self._resolve(dim, absent_ok=True))

    def get_local_rank(self) -> int:
        """This rank's index on its host: torchrun's ``LOCAL_RANK``.

        Without torchrun's variables vemesh assumes one host, so it is the global rank
        (``LOCAL_WORLD_SIZE`` alone gives ``rank % LOCAL_WORLD_SIZE``). With 4 devices
        per host, rank 5 gets 1 and rank 2 gets 2. Unlike veScale, vemesh never
        uses this number to find a mesh coordinate.
        """
        rank = self._my_rank()
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
        return self.layout.member(self._my_rank(), self._resolve(dim, absent_ok=True), local_rank)

    def to_local_rank(self, global_rank: int, dim: Dims) -> int:
        """Index of any ``global_rank`` inside its own group along ``dim``.

        ``to_local_rank(6, "DP")`` is 1 and ``to_local_rank(6, "TP")`` is 0 on every rank.
        """
        return self.layout.index_in_group(global_rank, self._resolve(dim, absent_ok=True))

    def get_neighbor_rank(self, dim: Dims, offset: int = 1, wrap: bool = False) -> int | None:
        """Global rank ``offset`` steps along ``dim`` from this rank, or None past the edge.

        ``get_neighbor_rank("PP")`` is 4 on rank 0 and None on rank 4 (4 gets 0 with
        ``wrap=True``); ``get_neighbor_rank("PP", -1)`` is 1 on rank 5.
        """
        offset = as_index(offset, "a neighbor offset")
        if not isinstance(wrap, bool):
            raise TypeError(f"wrap must be True or False; got {wrap!r}")
        rank, dims = self._my_rank(), self._resolve(dim, absent_ok=True)
        size = self.layout.group_size(dims)
        target = self.layout.index_in_group(rank, dims) + offset
        if wrap:
            target %= size
        elif not 0 <= target < size:
            return None
        return self.layout.member(rank, dims, target)

    # ================================================= views, groups, submeshes
    def __getitem__(self, dims: Dims) -> DeviceMesh:
        """The cached torch view of this rank's submesh along ``dims``.

        ``VESCALE_DEVICE_MESH["TP"]`` is ``DeviceMesh([4, 5])`` on rank 5 and ``[2, 3]`` on
        rank 3; ``["DP", "TP"]`` is ``[[4, 5], [6, 7]]`` on rank 5. A repeated lookup returns
        the same object from a dict (torch's own slicing rebuilds one each call).
        """
        try:
            return self._views[dims]
        except (KeyError, TypeError):
            pass
        self._my_rank()  # a rank outside a mesh over part of the world has no view of it
        mesh = self.mesh
        resolved = self._resolve(dims)
        names = self._names(dims, resolved)
        if names in self._views:
            view = self._views[names]
        else:
            view = mesh[names]
            self._views[names] = view
        if isinstance(dims, (str, tuple)):
            self._views[dims] = view
        return view

    def get_optional_mesh(self, dims: Dims) -> DeviceMesh | None:
        """Like ``mesh[dims]`` but None for an absent standard strategy: ``get_optional_mesh("CP")`` is None."""
        if not self._resolve(dims, absent_ok=True):
            return None
        return self[dims]

    def flatten(self, dims: Sequence[Dim], name: str | None = None) -> DeviceMesh:
        """Merge dims (given in mesh order) into one 1-D dim with its own process group.

        ``flatten(("DP", "TP"))`` makes ``"DP_TP"``: ``DeviceMesh([4, 5, 6, 7])`` on rank 5 and
        ``[0, 1, 2, 3]`` on rank 1, reachable afterwards as ``VESCALE_DEVICE_MESH["DP_TP"]``
        and usable by every query. Flattening again with the same name returns the same mesh.
        The dims may themselves be flattened ones (torchtitan's ``dp_cp`` from ``dp_replicate``
        and ``dp_shard_cp``), as long as they run in mesh order.
        """
        layout, mesh = self.layout, self.mesh
        if isinstance(dims, (str, int)):
            dims = (dims,)
        resolved = self._resolve(dims)  # dims, or flattened dims: ("dp_replicate", "dp_shard_cp") is fine
        names = self._names(dims, resolved)  # in mesh order, or ValueError
        name = name or "_".join(layout.dim_names[d] for d in resolved)
        check_dim_names((name,))
        if name in layout.dim_names:
            raise ValueError(f"flattened name {name!r} is already a dim of {layout.dim_names}; pick another")
        if name in self._dims:
            if self._dims[name] != resolved:
                taken = tuple(layout.dim_names[d] for d in self._dims[name])
                spelled = tuple(layout.dim_names[d] for d in resolved)
                raise ValueError(f"{name!r} already names the flattened dims {taken}, not {spelled}; pick another")
            return self._views[name]
        flat = mesh[names]._flatten(name)
        if self._timeout is not None and dist.get_backend() != "fake":
            apply_timeout([flat.get_group()], self._timeout)
        self._dims[name] = resolved
        self._views[name] = self._views[(name,)] = flat
        return flat

    def get_group(self, dim: Dim | None = None) -> dist.ProcessGroup:
        """This rank's process group along one dim (or a flattened dim).

        ``get_group("TP")`` holds ranks ``[4, 5]`` on rank 5; ``get_group("DP")`` holds
        ``[1, 3]`` on rank 1. ``dim`` may be omitted on a 1-D mesh.
        """
        if dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group() needs a dim on a {self.ndim}-D mesh; choose one of {self.mesh_dim_names}")
            return self.mesh.get_group()
        if len(self._resolve(dim)) != 1 and not (isinstance(dim, str) and dim in self._dims):
            raise ValueError(f"a process group runs along one dim; got {dim!r} (flatten() several dims first)")
        return self[dim].get_group()

    def get_submeshes(self, dims: Dims) -> list[DeviceMesh]:
        """Every submesh along ``dims``: the world partitioned, ordered by the other dims.

        ``get_submeshes("TP")`` is ``[[0, 1], [2, 3], [4, 5], [6, 7]]`` on every rank. The
        submesh holding this rank is the cached view, with its process group; the others
        are layout-only meshes (no process group is created for them).
        """
        resolved = self._resolve(dims)
        count = self.layout.world_size // self.layout.group_size(resolved)
        return [self._submesh_at(dims, resolved, i) for i in range(count)]

    def get_neighbor_submesh(
        self, view_dim: Dims, along: Dim, offset: int = 1, wrap: bool = False
    ) -> DeviceMesh | None:
        """The ``view_dim`` submesh ``offset`` steps ``along`` another dim, or None past the edge.

        ``get_neighbor_submesh("TP", along="PP")`` is the TP submesh of the next pipeline stage
        with the same other coordinates: ``[4, 5]`` on ranks 0 and 1, ``[6, 7]`` on rank 2,
        None on ranks 4..7 (``[0, 1]`` on rank 4 with ``wrap=True``).
        """
        view = self._resolve(view_dim)
        along_dims = self._resolve(along, absent_ok=True)
        if set(view) & set(along_dims):
            raise ValueError(f"along={along!r} must be a dim outside view_dim={view_dim!r}")
        neighbor = self.get_neighbor_rank(along, offset, wrap)
        if neighbor is None:
            return None
        return self._submesh_at(view_dim, view, self.layout.group_index(neighbor, view))

    # ======================================================= veScale-style names
    def get_tensor_parallel_rank(self) -> int:
        """This rank's TP index (0 when the mesh has no TP): 1 on rank 5, 0 on rank 4."""
        return self.lookup_rank("TP")

    def get_data_parallel_rank(self) -> int:
        """This rank's DP index (0 when the mesh has no DP): 1 on rank 6, 0 on rank 5."""
        return self.lookup_rank("DP")

    def get_pipeline_parallel_rank(self) -> int:
        """This rank's pipeline stage (0 when the mesh has no PP): 1 on rank 5, 0 on rank 2."""
        return self.lookup_rank("PP")

    def get_tensor_parallel_mesh(self) -> DeviceMesh:
        """``mesh["TP"]``: ``[4, 5]`` on rank 5 (veScale returned the wrong dim here)."""
        return self["TP"]

    def get_data_parallel_mesh(self) -> DeviceMesh:
        """``mesh["DP"]``: ``[5, 7]`` on rank 5."""
        return self["DP"]

    def get_pipeline_parallel_mesh(self) -> DeviceMesh:
        """``mesh["PP"]``: ``[1, 5]`` on rank 5 (veScale returned the TP submesh here)."""
        return self["PP"]

    def get_tensor_parallel_dim_groups(self) -> dist.ProcessGroup:
        """The group along TP: ranks ``[4, 5]`` on rank 5 (veScale returned the outermost group)."""
        return self.get_group("TP")

    def get_data_parallel_dim_groups(self) -> dist.ProcessGroup:
        """The group along DP: ranks ``[5, 7]`` on rank 5."""
        return self.get_group("DP")

    def get_global_tensor_parallel_meshes(self) -> list[DeviceMesh]:
        """Every TP submesh: ``[[0, 1], [2, 3], [4, 5], [6, 7]]`` on every rank."""
        return self.get_submeshes("TP")

    def get_global_pipeline_parallel_meshes(self) -> list[DeviceMesh]:
        """One submesh of the non-PP dims per pipeline stage, in stage order.

        On every rank: ``[DeviceMesh([[0, 1], [2, 3]]), DeviceMesh([[4, 5], [6, 7]])]``
        with dims ``("DP", "TP")``. Without a PP dim the whole mesh is the one stage.
        """
        layout = self.layout
        if "PP" not in layout.dim_names:
            return [self.mesh]
        others = tuple(n for n in layout.dim_names if n != "PP")
        if not others:
            raise ValueError("the mesh has only the PP dim, so each stage is one rank; use get_submeshes('PP')")
        return self.get_submeshes(others)

    def is_first_stage(self) -> bool:
        """True on pipeline stage 0 (ranks 0..3), and on every rank without PP."""
        return self.lookup_rank("PP") == 0

    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (ranks 4..7), and on every rank without PP."""
        return self.lookup_rank("PP") == self.get_strategy_size("PP") - 1

    # ============================================================== display
    def describe(self, rank: int | None = None, devices_per_host: int | None = None) -> str:
        """The layout as text: the rank grid, the groups along every dim, and ``rank``'s view.

        ``rank`` defaults to this rank. ``devices_per_host`` defaults to torchrun's
        ``LOCAL_WORLD_SIZE`` when set.
        """
        from .describe import describe_layout

        if devices_per_host is None and "LOCAL_WORLD_SIZE" in os.environ:
            devices_per_host = int(os.environ["LOCAL_WORLD_SIZE"])
        return describe_layout(
            self.layout,
            rank=self._my_rank() if rank is None else rank,
            devices_per_host=devices_per_host,
            flattened={n: d for n, d in self._dims.items() if n not in self.layout.dim_names},
        )

    def _log_layout(self) -> None:
        from .describe import check_layout

        per_host = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
        _logger.info("%s", self.describe(devices_per_host=per_host))
        for warning in check_layout(self.layout, per_host):
            _logger.warning("%s", warning)

    def __repr__(self) -> str:
        if self._layout is None:
            return "VeDeviceMesh(uninitialized)"
        dims = ", ".join(f"{n}={s}" for n, s in zip(self._layout.dim_names, self._layout.shape))
        where = f"coordinate={self._coordinate}" if self._member else "not a member"
        return f"VeDeviceMesh(({dims}), device_type={self.device_type!r}, rank={self._rank}, {where})"

    # ============================================================== helpers
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

    def _resolve(self, dims: Dims, absent_ok: bool = False) -> tuple[int, ...]:
        """Dim indices for a name, index, flattened name, or a sequence of names/indices."""
        layout = self.layout
        if isinstance(dims, str):
            found = self._dims.get(dims)
            if found is not None:
                return found
            if absent_ok and dims in STANDARD_STRATEGIES:
                return ()
            valid = list(self._dims)
            err = unknown_name_error("dim name", dims, valid)
            if absent_ok:
                err.args = (err.args[0] + f" (absent standard strategies {list(STANDARD_STRATEGIES)} have size 1)",)
            raise err
        if isinstance(dims, int) and not isinstance(dims, bool):
            return (layout.dim_index(dims),)
        if isinstance(dims, Sequence):
            out: list[int] = []
            for d in dims:
                out.extend(self._resolve(d, absent_ok))
            if len(set(out)) != len(out):
                raise ValueError(f"dims {tuple(dims)} name the same dim twice: {self._spell(dims)}")
            return tuple(out)
        raise TypeError(f"a dim is a name (str), an index (int) or a sequence of them; got {dims!r}")

    def _spell(self, dims: Dims) -> str:
        """``dims`` with each flattened name spelled out: ``dp_replicate, dp_shard_cp=(dp_shard, cp)``."""
        parts = [dims] if isinstance(dims, (str, int)) else list(dims)
        out = []
        for part in parts:
            if isinstance(part, str) and part in self._dims and part not in self.layout.dim_names:
                out.append(f"{part}=({', '.join(self.layout.dim_names[d] for d in self._dims[part])})")
            else:
                out.append(str(part))
        return ", ".join(out)

    def _parts(self, dims: Dims) -> list[Dims]:
        return [dims] if isinstance(dims, (str, int)) else list(dims)  # type: ignore[arg-type]

    def _names(self, dims: Dims, resolved: tuple[int, ...]) -> tuple[str, ...]:
        """The torch slicing key for ``dims``: dim and flattened names, whose dims must run in mesh order.

        ``("dp_replicate", "dp_shard_cp")`` on ``(dp_replicate, dp_shard, cp, tp)`` is a sub-mesh:
        its dims 0, then 1 and 2, keep mesh order, so every group's ranks are laid out as in the
        mesh. ``("dp_shard_cp", "dp_replicate")`` is not, and raises ``ValueError``.
        """
        if list(resolved) != sorted(resolved):
            raise ValueError(
                f"dims ({self._spell(dims)}) do not form a sub-mesh: their dims must run in mesh order "
                f"{self.layout.dim_names}"
            )
        names = []
        for part in self._parts(dims):
            if isinstance(part, str) and part in self._dims and part not in self.layout.dim_names:
                names.append(part)  # a flattened dim, sliced by its own name
            else:
                names.extend(self.layout.dim_names[d] for d in self._resolve(part))
        return tuple(names)

    def _submesh_at(self, dims: Dims, resolved: tuple[int, ...], index: int) -> DeviceMesh:
        """Submesh number ``index`` along ``dims`` (see :meth:`MeshLayout.all_groups`), cached."""
        key = (resolved, index)
        cached = self._submeshes.get(key)
        if cached is not None:
            return cached
        layout = self.layout
        names = self._names(dims, resolved)
        if self._member and layout.group_index(self._rank, resolved) == index:
            submesh = self[dims]
        else:
            ranks = torch.tensor(layout.group_at(resolved, index), dtype=torch.int)
            shape = [layout.group_size(self._resolve(name)) for name in names]
            submesh = DeviceMesh(self.device_type, ranks.view(shape), mesh_dim_names=names, _init_backend=False)
        self._submeshes[key] = submesh
        return submesh


#: The process-wide mesh manager.
VESCALE_DEVICE_MESH = VeDeviceMesh()
