"""Views of the mesh: torch ``DeviceMesh`` objects for any names, their process groups, and submeshes.

:class:`MeshViews` is the view cache of :class:`~vemesh.VeDeviceMesh`. Every name has
one 1-D torch mesh with its process group (a mesh dim is torch's own slice; a flattened
or split name gets its mesh when it is made); a view of several names is torch's slice
when they are all dims of torch's mesh, else their 1-D meshes side by side
(``DeviceMesh._concatenate``). Names are resolved by the layout alone.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vemesh.layout.mesh_layout import Dims

__all__ = ["MeshViews", "check_view"]


def check_view(mesh: DeviceMesh, what: str) -> None:
    """Refuse a torch view that ``VESCALE_DEVICE_MESH`` (or another ``VeDeviceMesh``) handed out before its last
    ``reset()`` or ``init_device_mesh``: its groups may be another mesh's now."""
    stamp = getattr(mesh, "_vemesh_epoch", None)
    if stamp is None:
        return
    owner, epoch = stamp[0](), stamp[1]
    if owner is not None and owner.epoch != epoch:
        now = repr(owner) if owner.is_initialized() else "reset and not initialized again"
        raise RuntimeError(
            f"{what} is a view of an earlier mesh (taken before the last init_device_mesh or reset(); the mesh is now "
            f"{now}): its groups may not be this mesh's. Take the view again, e.g. VESCALE_DEVICE_MESH['DP']"
        )


class MeshViews:
    """``mesh[dims]``, ``get_group``, ``get_submeshes`` and friends; the state lives on the ``VeDeviceMesh``."""

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
        names = self.layout.resolve(dims)
        if not names:
            raise ValueError(f"a view needs at least one dim; got {dims!r}")
        view = self._views.get(names)
        if view is None:
            view = self._views[names] = self._torch_view(names)
        if isinstance(dims, (str, tuple)):
            self._views[dims] = view
        return view

    def get_optional_mesh(self, dims: Dims) -> DeviceMesh | None:
        """Like ``mesh[dims]`` but None for an absent standard strategy: ``get_optional_mesh("CP")`` is None."""
        if not self.layout.resolve(dims, absent_ok=True):
            return None
        return self[dims]

    def get_group(self, dim: Dims | None = None) -> dist.ProcessGroup:
        """This rank's process group along one dim (a mesh dim, a flattened or a split one).

        ``get_group("TP")`` holds ranks ``[4, 5]`` on rank 5; ``get_group("DP")`` holds
        ``[1, 3]`` on rank 1. ``dim`` may be omitted on a 1-D mesh.
        """
        if dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group() needs a dim on a {self.ndim}-D mesh; choose one of {self.layout.names}")
            return self.mesh.get_group()
        if len(self.layout.resolve(dim)) != 1:
            raise ValueError(f"a process group runs along one dim; got {dim!r} (flatten() several dims first)")
        return self[dim].get_group()

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

    def hang_description(self) -> dict[str, Any]:
        """What a hang dump needs of the mesh (:mod:`vemesh.hangs`): the layout, and each group already made that
        holds this rank, by process-group name (its dim name and global ranks). No collective, no new group."""
        layout, mesh = self.layout, self.mesh
        made = {n: mesh for n in mesh.mesh_dim_names} | dict(self._dim_meshes)
        groups: dict[str, dict[str, Any]] = {}
        if self._member:
            for name, m in made.items():
                group = m.get_group(name) if m is mesh else m.get_group()
                groups[group.group_name] = {"dim": name, "ranks": dist.get_process_group_ranks(group)}
        world = dist.group.WORLD
        groups.setdefault(world.group_name, {"dim": "world", "ranks": list(range(dist.get_world_size()))})
        return {"shape": list(layout.shape), "dim_names": list(layout.dim_names), "strides": list(layout.strides),
                "first_rank": layout.first_rank, "coordinate": list(self._coordinate), "groups": groups}

    def _dim_mesh(self, name: str) -> DeviceMesh:
        """The 1-D torch mesh of one name; flattened and split names get theirs when they are made."""
        found = self._dim_meshes.get(name)
        if found is None:
            found = self._dim_meshes[name] = self._stamp(self.mesh[name])  # a dim of torch's mesh: torch's own slice
        return found

    def _stamp(self, mesh: DeviceMesh) -> DeviceMesh:
        """Mark ``mesh`` as this manager's, of this epoch, so that the wrappers refuse it after a reset or re-init."""
        mesh._vemesh_epoch = (weakref.ref(self), self._epoch)  # type: ignore[attr-defined]
        return mesh

    def _torch_view(self, names: tuple[str, ...]) -> DeviceMesh:
        """torch's mesh over ``names`` (already resolved): torch's slice, or the names' 1-D meshes side by side."""
        mesh = self.mesh
        if names == mesh.mesh_dim_names:
            return self._stamp(mesh)
        if len(names) == 1:
            return self._dim_mesh(names[0])
        if all(n in mesh.mesh_dim_names for n in names):
            return self._stamp(mesh[names])
        return self._stamp(DeviceMesh._concatenate([self._dim_mesh(n) for n in names]))

    def _submesh_at(self, dims: Dims, index: int) -> DeviceMesh:
        """Submesh number ``index`` along ``dims`` (see :meth:`MeshLayout.all_groups`), cached."""
        layout = self.layout
        names = layout.resolve(dims)
        key = (names, index)
        cached = self._submeshes.get(key)
        if cached is not None:
            return cached
        if self._member and layout.group_index(self._rank, names) == index:
            submesh = self[dims]
        else:
            ranks = torch.tensor(layout.group_at(names, index), dtype=torch.int)
            shape = [layout.group_size(name) for name in names]
            submesh = self._stamp(DeviceMesh(self.device_type, ranks.view(shape), mesh_dim_names=names, _init_backend=False))
        self._submeshes[key] = submesh
        return submesh
