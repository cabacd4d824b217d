"""The group a data-parallel wrapper reduces over: resolved, defaulted from the live mesh, and checked.

* :func:`resolve_group` turns what the user passed (a 1-D ``DeviceMesh``, a ``ProcessGroup``, a whole
  ``VeDeviceMesh`` or None) into a process group. A whole mesh means its data dims; None means the live mesh's
  (``grad`` of :func:`vemesh.layout.data_dims.data_dims`), not the world: on ``(DP, TP) = (2, 2)`` the world
  holds each rank's TP peer, and averaging with it would mix different shards. Without a live mesh, None is torch's default group, as in torch's DDP.
* :func:`sharded_over` says over which ranks a parameter is already sharded: a DTensor's non-replicated
  mesh dims, or a plain slice vemesh tagged (experts held by one EP rank).
* :func:`check_not_sharded_over` refuses a group that holds two ranks of one parameter's shards, naming
  the parameter, both groups and the fix. A view of an earlier mesh (before ``reset()`` or another
  ``init_device_mesh``) is refused (:func:`vemesh.mesh.views.check_view`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from vemesh.layout.data_dims import DATA_NAMES, batch_dims, data_dims
from vemesh.mesh import VESCALE_DEVICE_MESH, VeDeviceMesh
from vemesh.mesh.views import check_view

__all__ = ["SHARDED_OVER", "check_covers_data", "check_not_sharded_over", "data_ranks", "default_group", "resolve_group",
           "sharded_over"]

#: The attribute vemesh puts on a plain tensor that is one rank's slice of a whole (an EP rank's experts):
#: ``(dim name, global ranks holding the other slices, this one included)``.
SHARDED_OVER = "_vemesh_sharded_over"


def default_group() -> tuple[dist.ProcessGroup, str]:
    """The data-parallel group when none is given, and how it was chosen (for error messages).

    With a live ``VESCALE_DEVICE_MESH``: the group of its data dims (``grad`` of
    :func:`vemesh.layout.data_dims.data_dims`); a ``ValueError`` when there are none, or a dim's role is
    unknown, or no name covers them. Without one: torch's default group, as torch's DDP.
    """
    if not VESCALE_DEVICE_MESH.is_initialized():
        return dist.group.WORLD, "torch's default group (no VESCALE_DEVICE_MESH)"  # type: ignore[return-value]
    return _data_group(VESCALE_DEVICE_MESH, "VESCALE_DEVICE_MESH", "no data-parallel group was given, and ")


def _data_group(mesh: VeDeviceMesh, label: str, why: str = "") -> tuple[dist.ProcessGroup, str]:
    """The group of ``mesh``'s data dims (``grad`` of :func:`vemesh.layout.data_dims.data_dims`), and its description."""
    name = data_dims(mesh.layout).grad
    if name is None:
        raise ValueError(  # every dim has a known role (data_dims raised on one it does not know): DP is 1
            f"{why}{label} {mesh.mesh_dim_names} has no data dim (named one of {list(DATA_NAMES)}): data parallel is "
            f"1 on it, and there is nothing to average. Leave the model unwrapped on this mesh, or give "
            f"init_device_mesh a 'DP' dim of size 1 (its group is each rank alone)"
        )
    return mesh.get_group(name), f"{label}[{name!r}], the mesh's data dims"


def resolve_group(given: DeviceMesh | VeDeviceMesh | dist.ProcessGroup | None, what: str = "data_pg_or_device_mesh") -> tuple[dist.ProcessGroup, str]:
    """``given`` as a process group, and a description of it; None gives :func:`default_group`."""
    if given is None:
        return default_group()
    if isinstance(given, DeviceMesh):
        check_view(given, what)
        if given.ndim != 1:
            raise ValueError(
                f"{what} must be a 1-D DeviceMesh (e.g. mesh['DP']), got a {given.ndim}-D mesh "
                f"with shape {tuple(given.shape)} and dim names {given.mesh_dim_names}"
            )
        name = (given.mesh_dim_names or ("?",))[0]
        return given.get_group(), f"mesh[{name!r}]"
    if isinstance(given, dist.ProcessGroup):
        return given, "the ProcessGroup given"
    if isinstance(given, VeDeviceMesh):  # the whole mesh, as vemesh's fully_shard takes it
        if not given.is_initialized():
            raise ValueError(f"{what} is a VeDeviceMesh that is not initialized: call init_device_mesh on it first")
        if what == "data_pg_or_device_mesh":  # its data dims, as None means for the live mesh
            return _data_group(given, "mesh")
        raise TypeError(f"{what} must be a 1-D DeviceMesh, a ProcessGroup or None; got a whole VeDeviceMesh of dims "
                        f"{given.mesh_dim_names}: pass one of its views, mesh[NAME]")
    whole = ", a whole VeDeviceMesh (its data dims)" if what == "data_pg_or_device_mesh" else ""
    raise TypeError(f"{what} must be a 1-D DeviceMesh{whole}, a ProcessGroup or None, got {type(given).__name__}")


def check_covers_data(group: dist.ProcessGroup, described: str) -> None:
    """On a live mesh, ``ValueError`` unless ``group`` holds every rank of this rank's data dims (DP and CP).

    Each of those ranks holds a different part of the batch (CP ranks: other tokens of the same sequences), so a
    gradient averaged without some of them differs between them, and their replicas drift apart, silently:
    ``mesh["DP"]`` on a ``(DP, CP, TP)`` mesh, or ``mesh["dp_shard"]`` on an HSDP mesh, are refused.
    """
    needed = data_ranks()
    if not needed:
        return
    given = dist.get_process_group_ranks(group)
    missing = sorted(set(needed) - set(given))
    if missing:
        raise ValueError(
            f"the data-parallel group {sorted(given)} ({described}) leaves out ranks "
            f"{missing} of this rank's data dims {', '.join(_atoms())} ({needed}), which hold other parts of the batch: "
            f"their gradients would never meet. Average over all of them: VESCALE_DEVICE_MESH['DP'] when DP is the only "
            f"data dim, else flatten them (VESCALE_DEVICE_MESH.flatten({_atoms()!r}, 'dp_cp')) and pass that view"
        )


def _atoms() -> tuple[str, ...]:
    return tuple(batch_dims(VESCALE_DEVICE_MESH.layout))


def data_ranks() -> list[int] | None:
    """The global ranks of this rank's data dims (DP and CP: each holds another part of the batch) on the live
    ``VESCALE_DEVICE_MESH``; None without a live mesh this rank is in, or where the names do not tell the dims'
    roles (then a group given is the user's word)."""
    if not VESCALE_DEVICE_MESH.is_initialized() or not VESCALE_DEVICE_MESH.is_member():
        return None
    try:
        atoms = _atoms()
    except ValueError:
        return None
    return VESCALE_DEVICE_MESH.layout.group_ranks(dist.get_rank(), atoms) if atoms else None


def ranks_along(mesh: DeviceMesh, dim: int) -> list[int]:
    """The global ranks of this rank's group along mesh dim ``dim`` of ``mesh``."""
    if mesh.get_coordinate() is None:
        return []
    return dist.get_process_group_ranks(mesh.get_group(dim))


def sharded_over(p: torch.Tensor) -> Iterator[tuple[str, list[int], str]]:
    """``(dim name, ranks, how)`` for every way ``p`` is split over ranks: each non-replicated dim of a
    DTensor's mesh, and the :data:`SHARDED_OVER` tag of a plain slice."""
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        for i, placement in enumerate(p.placements):
            if not placement.is_replicate():
                name = mesh.mesh_dim_names[i] if mesh.mesh_dim_names else f"dim {i}"
                yield name, ranks_along(mesh, i), str(placement)
    tag = getattr(p, SHARDED_OVER, None)
    if tag is not None:
        yield tag[0], list(tag[1]), "one slice per rank"


def check_not_sharded_over(named: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup, described: str,
                           kind: str = "data-parallel", fix: str = "") -> None:
    """``ValueError`` if ``group`` holds two ranks over which one of the tensors is split (see :func:`sharded_over`).

    On ``(DP, TP) = (2, 2)``, a ``ColwiseParallel`` weight is sharded over ``[0, 1]`` on rank 0; the world
    ``[0, 1, 2, 3]`` holds both, so averaging over it would average two different shards: refused.
    ``mesh["DP"]`` (``[0, 2]``) holds one: accepted.
    """
    ranks = set(dist.get_process_group_ranks(group))
    if len(ranks) == 1:
        return
    seen: dict[tuple[str, tuple[int, ...]], bool] = {}
    for name, p in named:
        for dim, shard, how in sharded_over(p):
            key = (dim, tuple(shard))
            if seen.setdefault(key, len(ranks & set(shard)) > 1):
                both = sorted(ranks & set(shard))
                raise ValueError(
                    f"parameter {name!r} is split over ranks {shard} ({how} along {dim!r}), and the {kind} group "
                    f"{sorted(ranks)} ({described}) holds {len(both)} of them, {both}: averaging there mixes different "
                    f"shards. {fix or _fix(dim)}"
                )


def _fix(dim: str) -> str:
    if "ep" in dim.lower().split("_"):
        return ("It is one EP rank's slice of the experts: pass it in expert_parameters, with "
                "expert_data_parallel=VESCALE_DEVICE_MESH['EDP']")
    return (f"Reduce over the data dims only: pass VESCALE_DEVICE_MESH['DP'] (or the flattened data dims, e.g. "
            f"VESCALE_DEVICE_MESH['dp_cp']), a group without {dim!r} peers")
