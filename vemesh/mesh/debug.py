"""The mesh's display and its hooks into the hang watch: ``describe``, the start-up layout log, ``mark_step``,
and the description a hang dump carries.

Functions of what they are given (a layout, this rank's coordinate, the torch views): :class:`~vemesh.VeDeviceMesh`
calls them, and the watch itself (torch's Flight Recorder, the watchdog, the dumps) is :mod:`vemesh.hangs`, which
holds the mesh's :meth:`~vemesh.VeDeviceMesh.hang_description`, never the other way round.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from vemesh.hangs import record
from vemesh.hangs.process import HANGS
from vemesh.layout.describe import check_layout, describe_layout
from vemesh.layout.mesh_layout import MeshLayout
from vemesh.mesh.views import TorchViews

__all__ = ["describe", "hang_description", "hang_dir", "log_layout", "mark_step", "watch_hangs"]

_logger = logging.getLogger("vemesh")


def _per_host(devices_per_host: int | None) -> int | None:
    if devices_per_host is None and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return devices_per_host


def describe(layout: MeshLayout, rank: int, devices_per_host: int | None = None) -> str:
    """The layout as text from ``rank``'s view; ``devices_per_host`` defaults to torchrun's ``LOCAL_WORLD_SIZE``."""
    return describe_layout(layout, rank=rank, devices_per_host=_per_host(devices_per_host))


def mark_step(step: int) -> None:
    """The training step this rank is on, for the hang watch (see :meth:`vemesh.VeDeviceMesh.mark_step`)."""
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"mark_step takes the step as an int; got {step!r}")
    HANGS.mark_step(step)


def log_layout(mesh: Any) -> None:
    """Log ``mesh.describe()`` and the layout's warnings (a TP group across hosts) to the ``vemesh`` logger."""
    per_host = _per_host(None)
    _logger.info("%s", mesh.describe(devices_per_host=per_host))
    for warning in check_layout(mesh.layout, per_host):
        _logger.warning("%s", warning)


def hang_dir(given: Any) -> str | None:
    """The directory of the hang watch (``hang_dir=``, else ``VEMESH_HANG_DIR``), with the recorder turned on."""
    found = os.fspath(given) if given is not None else os.environ.get(record.ENV_DIR) or None
    if found is not None:
        record.prepare()
    return found


def watch_hangs(directory: str, timeout_s: float, description: Callable[[], dict[str, Any]]) -> None:
    """Start the hang watch over ``directory`` (not on the fake backend); ``description`` is the mesh's."""
    if dist.get_backend() == "fake":
        return
    HANGS.start(directory, timeout_s, description)
    if not record.recorder_json(entries=False).get("pg_status"):
        raise RuntimeError(
            f"{record.ENV_DIR}={directory}: torch's Flight Recorder recorded none of the start-up's collectives, "
            "so it was off when they ran; set VEMESH_HANG_DIR (or TORCH_FR_BUFFER_SIZE) in the environment "
            "before the process starts, or pass hang_dir= before any other collective"
        )


def hang_description(layout: MeshLayout, coordinate: tuple[int, ...], views: TorchViews, member: bool) -> dict[str, Any]:
    """The layout, and each group already made that holds this rank, by process-group name (its dim name and global
    ranks). No collective, no new group."""
    mesh = views.mesh
    groups: dict[str, dict[str, Any]] = {}
    if member:
        for name, m in views.made().items():
            group = m.get_group(name) if m is mesh else m.get_group()
            groups[group.group_name] = {"dim": name, "ranks": dist.get_process_group_ranks(group)}
    world = dist.group.WORLD
    groups.setdefault(world.group_name, {"dim": "world", "ranks": list(range(dist.get_world_size()))})
    # the groups of the user's own (dist.new_group): their members, which a dump cannot see where some never entered
    for group, members in dist.distributed_c10d._world.pg_group_ranks.items():
        if dist.get_rank() in members and group.group_name not in groups:
            desc = getattr(group, "group_desc", "")
            groups[group.group_name] = {"dim": f"group {group.group_name}" + (f" ({desc})" if desc not in ("", "undefined")
                                                                              else ""), "ranks": sorted(members)}
    return {"shape": list(layout.shape), "dim_names": list(layout.dim_names), "strides": list(layout.strides),
            "first_rank": layout.first_rank, "coordinate": list(coordinate), "groups": groups}
