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

This class holds the layout and this rank's place in it, and answers the queries; it owns one
:class:`~vemesh.mesh.views.TorchViews` per epoch (torch's meshes, their groups and caches). Start-up lives in
:func:`vemesh.mesh.startup.build_mesh`, the display and the hang watch's hooks in :mod:`vemesh.mesh.debug`, and
veScale's method names (over the public queries only) in :mod:`vemesh.mesh.vescale_names`. The fault-tolerant
replica dim (:mod:`vemesh.ft`) answers for its own name; the mesh only reserves it (:meth:`VeDeviceMesh.reserve`).
A mesh whose process group was destroyed raises on every question (:func:`~vemesh.mesh.startup.check_world`).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import vemesh.mesh.debug as debug
from vemesh.mesh.lineage import track as track_ties
from vemesh.layout.mesh_layout import Dims, MeshLayout
from vemesh.mesh.queries import LayoutQueries, torch_dim
from vemesh.mesh.startup import C10D_WORLD, apply_timeout, build_mesh, check_world, world_gone
from vemesh.mesh.vescale_names import VeScaleAliases
from vemesh.mesh.views import TorchViews, torch_only

__all__ = ["VeDeviceMesh", "VESCALE_DEVICE_MESH"]

_logger = logging.getLogger("vemesh")

_NOT_INITIALIZED = (
    "the device mesh is not initialized; call "
    "VESCALE_DEVICE_MESH.init_device_mesh(device_type, mesh_shape, mesh_dim_names=...) first"
)


class VeDeviceMesh(LayoutQueries, VeScaleAliases):
    """A manager for one global torch ``DeviceMesh`` plus rank arithmetic for any rank.

    ``VESCALE_DEVICE_MESH`` is the process-wide instance; ``VeDeviceMesh()``
    builds an independent one (handy in tests). All state lives on the
    instance; :meth:`reset` drops it.
    """

    def __init__(self) -> None:
        self._torch: TorchViews | None = None  # torch's meshes of this epoch, with their groups and caches
        self._layout: MeshLayout | None = None
        self._rank = -1
        self._coordinate: tuple[int, ...] = ()
        self._member = False  # whether this rank is in the mesh (a mesh may cover part of the world)
        self._timeout: timedelta | None = None  # given to every group this mesh creates
        self._epoch = 0  # one more at every reset(): views of an older epoch are refused by the wrappers
        self._entered: list[DeviceMesh] = []  # the torch meshes ``with`` made current, innermost last
        self._built_on: dist.ProcessGroup | None = None  # the default process group the mesh was built on

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

        Under torchrun the process group comes from its environment; a plain ``python script.py`` gets a one-rank
        group. Every rank must pass the same arguments: on a real backend a mismatch raises ``ValueError`` on every
        rank instead of hanging in group creation.
        """
        if check_uniqueness and self._torch is not None:
            raise RuntimeError(
                f"the device mesh is already initialized as {self!r}; call reset() first "
                "or pass check_uniqueness=False to replace it"
            )
        hang_dir = debug.hang_dir(hang_dir)
        mesh, layout, group_timeout = build_mesh(
            device_type, mesh_shape, mesh_dim_names, timeout, backend_override, rank_offset
        )
        self.reset()
        self._timeout, self._rank, self._built_on = group_timeout, dist.get_rank(), dist.group.WORLD
        self._torch = TorchViews(mesh, self._stamp, self._track)
        self._set_layout(layout)
        if log_layout is None:
            log_layout = os.environ.get("VEMESH_LOG_LAYOUT", "0") not in ("", "0")
        if log_layout and self._rank == 0:
            debug.log_layout(self)
        if hang_dir is not None:  # after the layout: the dumps describe the mesh
            timeout_s = (group_timeout or dist.default_pg_timeout).total_seconds()
            debug.watch_hangs(hang_dir, timeout_s, self.hang_description)
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
        layout, views = self.layout, self._views()
        flat = layout.flatten(dims, name)
        name = layout.flat_name(dims, name)
        if flat is not layout:
            views.flatten(layout.resolve((dims,) if isinstance(dims, (str, int)) else dims), name)
            self._set_layout(flat)
        return views.dim_mesh(name)

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
        layout, views = self.layout, self._views()
        new = layout.split(dim, names, sizes)
        names, sizes = tuple(names), tuple(sizes)
        views.split(dim, layout.dim_index(dim) if dim in layout.dim_names else None, names, sizes)
        self._set_layout(new)
        return views.torch_view(names)

    def reserve(self, name: str) -> None:
        """Keep ``name`` for a dim that lives outside this mesh, until :meth:`reset` or the next init.

        The fault-tolerant replica dim of :func:`vemesh.ft.start_replicas` is one: other jobs, outside this world,
        whose membership torchft decides every step. The :class:`vemesh.ft.Replicas` answer for it; the mesh holds
        only the name, so that every query of it (size, rank, group, view, flatten) raises saying so.
        """
        self._set_layout(self.layout.with_managed(name))

    def get(self, **kwargs: Any) -> DeviceMesh:
        """The global torch mesh, initialized from ``kwargs`` on the first call (``get()`` before init raises)."""
        if kwargs and not self.is_initialized():
            return self.init_device_mesh(**kwargs)
        return self._views().mesh

    def is_initialized(self) -> bool:
        """Whether :meth:`init_device_mesh` has run, and neither :meth:`reset` nor ``destroy_process_group()`` since."""
        return self._torch is not None and C10D_WORLD._default_pg is self._built_on  # its world is the default one

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
        self._torch, self._layout, self._rank, self._coordinate, self._member = None, None, -1, (), False
        self._timeout, self._built_on = None, None
        self._epoch += 1

    # ============================================================= the mesh
    @property
    def mesh(self) -> DeviceMesh:
        """The global torch ``DeviceMesh`` (the same on every rank)."""
        return self._views().mesh

    @property
    def layout(self) -> MeshLayout:
        """The mesh as pure arithmetic, with every name (:class:`~vemesh.layout.MeshLayout`)."""
        if self._layout is None:
            raise RuntimeError(_NOT_INITIALIZED)
        if C10D_WORLD._default_pg is not self._built_on:  # its world is gone: raise (about 30 ns when it is not)
            check_world(self._built_on, self._layout)
        return self._layout

    @property
    def device_type(self) -> str:
        return self.mesh.device_type

    # ================================================================ views
    def __getitem__(self, dims: Dims) -> DeviceMesh:
        """The cached torch view of this rank's submesh along ``dims``.

        ``VESCALE_DEVICE_MESH["TP"]`` is ``DeviceMesh([4, 5])`` on rank 5 and ``[2, 3]`` on
        rank 3; ``["DP", "TP"]`` is ``[[4, 5], [6, 7]]`` on rank 5. A repeated lookup returns
        the same object from a dict (torch's own slicing rebuilds one each call).
        """
        views = self._views()
        found = views.cached(dims)
        if found is not None:
            return found
        self.get_rank()  # a rank outside a mesh over part of the world has no view of it
        names = self.layout.resolve(dims)
        if not names:
            raise ValueError(f"a view needs at least one dim; got {dims!r}")
        return views.view(dims, names)

    def get_optional_mesh(self, dims: Dims) -> DeviceMesh | None:
        """Like ``mesh[dims]`` but None for an absent standard strategy: ``get_optional_mesh("CP")`` is None."""
        return self[dims] if self.layout.resolve(dims, absent_ok=True) else None

    def get_group(self, dim: Dims | None = None, *, mesh_dim: Dims | None = None) -> dist.ProcessGroup:
        """This rank's process group along one dim (a mesh dim, a flattened or a split one).

        ``get_group("TP")`` holds ranks ``[4, 5]`` on rank 5; ``get_group("DP")`` holds
        ``[1, 3]`` on rank 1. ``dim`` may be omitted on a 1-D mesh; ``mesh_dim=`` is torch's name for it.
        """
        dim = torch_dim(dim, mesh_dim, "get_group")
        if dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group() needs a dim on a {self.ndim}-D mesh; choose one of {self.layout.names}")
            return self.mesh.get_group()
        if len(self.layout.resolve(dim)) != 1:
            raise ValueError(f"a process group runs along one dim; got {dim!r} (flatten() several dims first)")
        return self[dim].get_group()

    def get_all_groups(self) -> list[dist.ProcessGroup]:
        """This rank's group along each mesh dim, in mesh order, as torch's ``DeviceMesh.get_all_groups()``."""
        return [self.get_group(name) for name in self.mesh_dim_names]

    def __enter__(self) -> VeDeviceMesh:
        """``with VESCALE_DEVICE_MESH:`` is torch's ``with mesh:`` on the global torch mesh (the one entered)."""
        self._entered.append(self.mesh.__enter__())
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered.pop().__exit__(*exc)

    def __getattr__(self, name: str) -> Any:  # only what the class and the instance lack: torch's privates
        views = self.__dict__.get("_torch")
        if views is not None and not name.startswith("__") and hasattr(views.mesh, name):
            raise AttributeError(torch_only(name))
        raise AttributeError(f"'VeDeviceMesh' object has no attribute {name!r}")

    def get_submeshes(self, dims: Dims) -> list[DeviceMesh]:
        """Every submesh along ``dims``: the world partitioned, ordered by the other dims.

        ``get_submeshes("TP")`` is ``[[0, 1], [2, 3], [4, 5], [6, 7]]`` on every rank. The
        submesh holding this rank is the cached view, with its process group; the others
        are layout-only meshes (no process group is created for them).
        """
        layout = self.layout
        count = layout.world_size // layout.group_size(dims)
        return [self._submesh_at(dims, i) for i in range(count)]

    def get_neighbor_submesh(self, view_dim: Dims, along: Dims, offset: int = 1, wrap: bool = False) -> DeviceMesh | None:
        """The ``view_dim`` submesh ``offset`` steps ``along`` another dim, or None past the edge.

        ``get_neighbor_submesh("TP", along="PP")`` is the TP submesh of the next pipeline stage
        with the same other coordinates: ``[4, 5]`` on ranks 0 and 1, ``[6, 7]`` on rank 2,
        None on ranks 4..7 (``[0, 1]`` on rank 4 with ``wrap=True``).
        """
        layout = self.layout
        view = {a for n in layout.resolve(view_dim) for a in layout.named(n).parts}
        if view & {a for n in layout.resolve(along, absent_ok=True) for a in layout.named(n).parts}:
            raise ValueError(f"along={along!r} must be a dim outside view_dim={view_dim!r}")
        neighbor = self.get_neighbor_rank(along, offset, wrap)
        if neighbor is None:
            return None
        return self._submesh_at(view_dim, layout.group_index(neighbor, view_dim))

    # ============================================================ debugging
    def describe(self, rank: int | None = None, devices_per_host: int | None = None) -> str:
        """The layout as text: the rank grid, the groups along every name, and ``rank``'s view.

        ``rank`` defaults to this rank. ``devices_per_host`` defaults to torchrun's ``LOCAL_WORLD_SIZE`` when set.
        """
        return debug.describe(self.layout, self.get_rank() if rank is None else rank, devices_per_host)

    def mark_step(self, step: int) -> None:
        """Tell the hang watch which training step this rank is on (call it at the top of each step).

        ``vemesh diagnose`` then says the step of each collective ("DP all-reduce #42 at step 57").
        Straggler reports then give the time a rank held each group up per step. Costs a list append.
        """
        debug.mark_step(step)

    def hang_description(self) -> dict[str, Any]:
        """What a hang dump needs of the mesh (:mod:`vemesh.hangs`): the layout, and each group already made that
        holds this rank, by process-group name (its dim name and global ranks). No collective, no new group."""
        return debug.hang_description(self.layout, self._coordinate, self._views(), self._member)

    def __repr__(self) -> str:
        if self._layout is None:
            return "VeDeviceMesh(uninitialized)"
        dims = ", ".join(f"{n}={s}" for n, s in zip(self._layout.dim_names, self._layout.shape))
        gone = world_gone(self._built_on)
        if gone is not None:
            return f"VeDeviceMesh(({dims}), stale: its process group {gone})"
        where = f"coordinate={self._coordinate}" if self._member else "not a member"
        return f"VeDeviceMesh(({dims}), device_type={self.device_type!r}, rank={self._rank}, {where})"

    # ============================================================== helpers
    def _set_layout(self, layout: MeshLayout) -> None:
        """Adopt ``layout`` (after init, a flatten or a split); views are rebuilt from the 1-D meshes on demand."""
        self._layout = layout
        self._member = layout.first_rank <= self._rank < layout.first_rank + layout.world_size
        self._coordinate = layout.coordinate(self._rank) if self._member else ()
        self._views().forget()

    def _submesh_at(self, dims: Dims, index: int) -> DeviceMesh:
        """Submesh number ``index`` along ``dims`` (see :meth:`MeshLayout.all_groups`), cached."""
        layout = self.layout
        names = layout.resolve(dims)
        mine = self._member and layout.group_index(self._rank, names) == index
        return self._views().submesh_at(layout, names, index, mine)

    def _views(self) -> TorchViews:
        if self._torch is None:
            raise RuntimeError(_NOT_INITIALIZED)
        if C10D_WORLD._default_pg is not self._built_on:  # its world is gone: raise (about 30 ns when it is not)
            check_world(self._built_on, self._layout)
        return self._torch

    def _stamp(self, mesh: DeviceMesh) -> DeviceMesh:
        """Mark ``mesh`` as this manager's, of this epoch, so that the wrappers refuse it after a reset or re-init."""
        mesh._vemesh_epoch = (weakref.ref(self), self._epoch)  # type: ignore[attr-defined]
        return mesh

    def _track(self, groups: list[dist.ProcessGroup]) -> None:
        """Give groups this mesh created after init the mesh's timeout."""
        if self._timeout is not None and dist.get_backend() != "fake":
            apply_timeout([g for g in groups if g is not None], self._timeout)

    def get_rank(self) -> int:
        """This rank's global rank; ``RuntimeError`` before init, or on a rank outside a mesh over part of the world."""
        self._views()  # RuntimeError before init, or once the mesh's world is gone
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

track_ties()  # before any parallelize_module, which needs the mesh: a tie it breaks is then known (parallel/ties.py)
