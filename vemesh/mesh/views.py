"""The torch objects of one mesh: :class:`TorchViews`, owned by :class:`~vemesh.VeDeviceMesh` for one epoch.

Every name has one 1-D torch mesh with its process group (a mesh dim is torch's own slice; a flattened or split
name gets its mesh when it is made); a view of several names is torch's slice when they are all dims of torch's
mesh, else their 1-D meshes side by side (``DeviceMesh._concatenate``). The names are resolved by the caller's
layout, which is passed in: this object holds torch's meshes and their caches, and nothing about names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vemesh.layout.mesh_layout import Dims, MeshLayout

__all__ = ["TorchViews", "check_view", "torch_only"]


def torch_only(name: str) -> str:
    """What a torch function that took ``VESCALE_DEVICE_MESH`` for a ``DeviceMesh`` meets when it reads one of the
    torch mesh's own attributes (``name``), which the manager does not stand in for."""
    return (f"VESCALE_DEVICE_MESH has no {name!r}, which torch's DeviceMesh has: it is vemesh's manager of the "
            "mesh, not a torch DeviceMesh. Give torch's functions (distribute_tensor, fully_shard, "
            "parallelize_module, DCP) VESCALE_DEVICE_MESH.mesh, the global torch mesh, or a view such as "
            "VESCALE_DEVICE_MESH['TP']")


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


class TorchViews:
    """torch's global ``DeviceMesh`` of one initialized mesh, a 1-D mesh per name, views and submeshes, cached.

    Args:
        mesh: torch's global mesh, as ``init_device_mesh`` built it.
        stamp: marks a torch mesh as of this epoch (the wrappers refuse views of an earlier one); returns it.
        track: gives the groups made after start-up the mesh's timeout.

    Built at ``init_device_mesh``, dropped at ``reset``: a new epoch starts with none of these objects.
    """

    def __init__(self, mesh: DeviceMesh, stamp: Callable[[DeviceMesh], DeviceMesh],
                 track: Callable[[list[dist.ProcessGroup]], None]) -> None:
        self.mesh = stamp(mesh)
        self._stamp, self._track = stamp, track
        self._dim_meshes: dict[str, DeviceMesh] = {}  # name -> its 1-D torch mesh, with its process group
        self._views: dict[Any, DeviceMesh] = {}  # key as the user wrote it, or resolved names -> view
        self._submeshes: dict[tuple[tuple[str, ...], int], DeviceMesh] = {}

    def forget(self) -> None:
        """Drop the views and submeshes (the layout changed); the 1-D meshes and their groups stay."""
        self._views, self._submeshes = {}, {}

    def cached(self, dims: Dims) -> DeviceMesh | None:
        """The view cached under ``dims`` as the user wrote it, or None."""
        try:
            return self._views.get(dims)
        except TypeError:  # an unhashable key is resolved (and refused) by the layout
            return None

    def view(self, dims: Dims, names: tuple[str, ...]) -> DeviceMesh:
        """The view of ``names`` (``dims`` resolved), cached under both."""
        view = self._views.get(names)
        if view is None:
            view = self._views[names] = self.torch_view(names)
        if isinstance(dims, (str, tuple)):
            self._views[dims] = view
        return view

    def dim_mesh(self, name: str) -> DeviceMesh:
        """The 1-D torch mesh of one name; flattened and split names get theirs when they are made."""
        found = self._dim_meshes.get(name)
        if found is None:
            found = self._dim_meshes[name] = self._stamp(self.mesh[name])  # a dim of torch's mesh: torch's own slice
        return found

    def torch_view(self, names: tuple[str, ...]) -> DeviceMesh:
        """torch's mesh over ``names`` (already resolved): torch's slice, or the names' 1-D meshes side by side."""
        mesh = self.mesh
        if names == mesh.mesh_dim_names:
            return mesh
        if len(names) == 1:
            return self.dim_mesh(names[0])
        if all(n in mesh.mesh_dim_names for n in names):
            return self._stamp(mesh[names])
        return self._stamp(DeviceMesh._concatenate([self.dim_mesh(n) for n in names]))

    def submesh_at(self, layout: MeshLayout, names: tuple[str, ...], index: int, mine: bool) -> DeviceMesh:
        """Submesh number ``index`` along ``names`` (see :meth:`MeshLayout.all_groups`), cached; ``mine``: it holds
        this rank, so it is the view with its process group, else a layout-only mesh."""
        key = (names, index)
        cached = self._submeshes.get(key)
        if cached is not None:
            return cached
        if mine:
            submesh = self.view(names, names)
        else:
            ranks = torch.tensor(layout.group_at(names, index), dtype=torch.int)
            shape = [layout.group_size(name) for name in names]
            submesh = self._stamp(DeviceMesh(self.mesh.device_type, ranks.view(shape), mesh_dim_names=names,
                                             _init_backend=False))
        self._submeshes[key] = submesh
        return submesh

    def flatten(self, names: tuple[str, ...], name: str) -> None:
        """Make ``name``'s 1-D mesh and group over ``names`` (resolved, in mesh order)."""
        mesh = self.torch_view(names)._flatten(name)
        self._track([mesh.get_group()])
        self._dim_meshes[name] = self._stamp(mesh)

    def split(self, dim: str, index: int | None, names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
        """Make the 1-D meshes and groups of ``names``, the parts of ``dim`` (torch mesh dim ``index``, or None for
        a flattened or split dim, which keeps its own mesh)."""
        if index is not None:  # the torch mesh itself gets the finer dims
            self.dim_mesh(dim)  # keep the dim's own 1-D mesh and group: it answers for the name from now on
            unflat = self.mesh = self._stamp(self.mesh._unflatten(index, sizes, names))
        else:
            unflat = self.dim_mesh(dim)._unflatten(0, sizes, names)
        parts = {n: self._stamp(unflat[n]) for n in names}
        self._track([m.get_group() for m in parts.values()])
        self._dim_meshes.update(parts)

    def made(self) -> dict[str, DeviceMesh]:
        """Every name whose 1-D mesh (with its process group) exists: torch's mesh dims and those made since."""
        return {n: self.mesh for n in self.mesh.mesh_dim_names} | dict(self._dim_meshes)
