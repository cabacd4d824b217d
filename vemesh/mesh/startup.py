"""Start-up: bring up the default process group, check every rank asks for the same mesh, build torch's mesh.

Kept apart from :mod:`vemesh.mesh` so the mesh manager reads as queries and a view cache.
Everything here runs once per ``init_device_mesh``; :func:`build_mesh` is the one entry.
"""

from __future__ import annotations

import hashlib
import os
import socket
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from vemesh.layout.mesh_layout import MeshLayout
from vemesh.layout.spec import MeshSpec

__all__ = [
    "DEFAULT_TIMEOUT", "as_timeout", "apply_timeout", "bound_device", "build_mesh", "check_same_on_all_ranks",
    "C10D_WORLD", "check_world", "ensure_process_group", "world_gone",
]

#: How long a collective, or the start-up rendezvous, waits for the other ranks (NCCL's default;
#: torch's gloo default is 30 minutes).
DEFAULT_TIMEOUT = timedelta(minutes=10)


def as_timeout(value: object) -> timedelta:
    """A ``timedelta`` from a ``timedelta`` or a number of seconds; ``None`` gives :data:`DEFAULT_TIMEOUT`."""
    if value is None:
        return DEFAULT_TIMEOUT
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or a number of seconds; got {value!r}")
    if not seconds > 0:
        raise ValueError(f"timeout must be positive; got {value!r}")
    return timedelta(seconds=seconds)


def build_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    mesh_dim_names: Sequence[str] | None,
    timeout: timedelta | float | None,
    backend_override: Mapping[str | int, Any] | None,
    rank_offset: int | None,
) -> tuple[DeviceMesh, MeshLayout, timedelta | None]:
    """Everything ``VeDeviceMesh.init_device_mesh`` does before it answers queries.

    Validates the request, checks the device, creates the default process group if there is
    none, resolves ``-1``, checks that every rank asked for the same mesh, and builds torch's
    mesh (over part of the world when ``rank_offset`` is given).

    Returns:
        ``(mesh, layout, group_timeout)``: torch's ``DeviceMesh``, its :class:`MeshLayout`, and
        the timeout to give every group the mesh creates later (None: keep torch's own).
    """
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
            stacklevel=3,
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
    override = _check_backend_override(backend_override, layout)
    if layout.first_rank == 0 and layout.world_size == dist.get_world_size():
        mesh = _torch_init_device_mesh(
            spec.device_type, layout.shape, mesh_dim_names=layout.dim_names, backend_override=override
        )
    else:  # part of the world: every rank builds it (group creation is collective), members use it
        ranks = torch.arange(layout.first_rank, layout.first_rank + layout.world_size).view(layout.shape)
        mesh = DeviceMesh(spec.device_type, ranks, mesh_dim_names=layout.dim_names,
                          backend_override=tuple(_override_tuple(override, layout)))
    group_timeout = wait if (created or timeout is not None) else None
    if group_timeout is not None and dist.get_backend() != "fake":
        keep = {layout.dim_index(k) for k, v in (override or {}).items() if not isinstance(v, str)}
        apply_timeout([mesh.get_group(d) for d in range(mesh.ndim) if d not in keep], group_timeout)
    return mesh, layout, group_timeout


def _check_backend_override(override: Mapping[str | int, Any] | None, layout: MeshLayout) -> dict | None:
    """``backend_override`` checked against the mesh's dims (KeyError names the valid ones)."""
    if override is None:
        return None
    if not isinstance(override, Mapping):
        raise TypeError(f"backend_override must be a dict from dim name (or index) to a backend; got {override!r}")
    out = {}
    options_type = getattr(dist.ProcessGroup, "Options", None) or getattr(dist.Backend, "Options", ())
    for key, value in override.items():
        layout.dim_index(key)  # KeyError naming the valid dims, or TypeError/ValueError for an index
        ok = isinstance(value, str) or (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str))
        if not ok and not (options_type and isinstance(value, options_type)):
            raise TypeError(
                f"backend_override[{key!r}] must be a backend name such as 'gloo', process-group options, "
                f"or (backend, options); got {value!r}"
            )
        out[key] = value
    return out


def _override_tuple(override: dict | None, layout: MeshLayout) -> Iterator[tuple[Any, Any]]:
    """``backend_override`` as the per-dim ``(backend, options)`` tuple that DeviceMesh takes."""
    for d in range(layout.ndim):
        value = next((v for k, v in (override or {}).items() if layout.dim_index(k) == d), None)
        yield (value, None) if isinstance(value, str) else (value if isinstance(value, tuple) else (None, value))


def ensure_process_group(device_type: str, timeout: timedelta) -> bool:
    """Create the default process group if there is none (torchrun's env, or one local rank).

    Every rank first checks in at the job's store and waits (at most ``timeout``) for all the
    others, so a rank that crashed or exited before ``init_device_mesh`` is named instead of
    leaving the rest blocked. Returns whether it created the group.
    """
    if dist.is_initialized():
        return False
    accel = dist.Backend.default_device_backend_map.get(device_type)
    backend = "gloo" if device_type == "cpu" or accel is None else f"cpu:gloo,{device_type}:{accel}"
    if "WORLD_SIZE" in os.environ or "RANK" in os.environ:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _job_store(rank, world_size, timeout)
        _wait_for_everyone(store, rank, world_size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=bound_device(device_type, rank))
    else:  # a plain `python script.py`: one rank, no rendezvous needed
        dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore(), timeout=timeout,
                                device_id=bound_device(device_type, 0))
    return True


def bound_device(device_type: str, rank: int) -> torch.device | None:
    """The accelerator this rank works on, selected and given to ``init_process_group`` as ``device_id`` (None on
    the CPU): torch then forms NCCL's communicator at once, so that a failure to form it is raised at start-up and
    not at the first collective, and builds each mesh dim's group by splitting it rather than from scratch.

    The device is the one torch's ``DeviceMesh`` would select: the current device where one was already selected
    (``torch.cuda.set_device`` before the mesh), else torchrun's ``LOCAL_RANK``, else the rank modulo the devices
    of the host; with ``CUDA_VISIBLE_DEVICES`` giving a process fewer devices, modulo those it sees.
    """
    module = getattr(torch, device_type, None)
    if device_type == "cpu" or module is None or not module.is_available() or module.device_count() == 0:
        return None
    if module.is_initialized():
        index = module.current_device()
    else:
        index = int(os.environ.get("LOCAL_RANK", rank)) % module.device_count()
        module.set_device(index)
    return torch.device(device_type, index)


def _job_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The job's key-value store, with this restart attempt's keys kept apart where the store outlives an attempt.

    Under torchrun it is either the agent's store, shared with the workers and kept over every rendezvous round,
    or (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as multi-node elastic jobs need) one that rank 0 hosts at the
    port the round's rendezvous picked, new each round. torch 2.13's torchrun hands the agent's store to the
    workers it restarts (``--max-restarts``) without prefixing keys per attempt, so a restarted worker would read
    the previous attempt's keys and fail with "Gloo connectFullMesh failed ... Connection refused"; there the
    ``TORCHELASTIC_RESTART_COUNT`` prefix keeps each attempt apart, as torch's own ``env://`` does. A store of
    rank 0's is new each attempt and gets no such prefix: the restart count is each agent's own (a node whose
    workers failed counts a restart; the others restart for the new round without counting), so after one failure
    the nodes' workers would wait on each other under different prefixes until every restart was spent. Without
    the agent (``MASTER_ADDR``/``MASTER_PORT`` set by another launcher), rank 0 hosts it, as env:// does.
    """
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        if agent:
            store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
        else:
            store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        host = "torchrun's agent" if agent else "rank 0"
        raise RuntimeError(
            f"init_device_mesh on rank {rank}: could not reach the job's store at {addr}:{port} ({host}) within "
            f"{timeout.total_seconds():.0f} s: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        ) from None
    if not agent:
        return dist.PrefixStore("/vemesh", store)
    return dist.PrefixStore(f"/vemesh/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _wait_for_everyone(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
    keys = [f"arrived/{r}" for r in range(world_size)]
    store.set(keys[rank], socket.gethostname())
    try:
        store.wait(keys, timeout)
    except RuntimeError:  # DistStoreError: the wait timed out
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(
            f"init_device_mesh on rank {rank}: rank{'s' if len(missing) > 1 else ''} {missing} of {world_size} never "
            f"arrived within {timeout.total_seconds():.0f} s (crashed, exited early, or never started); "
            f"the other {world_size - len(missing)} did{_apart_hint()}"
        ) from None


def _apart_hint() -> str:
    """Where torchrun's agents share their store over several nodes, after a failure their restart counts (and so
    their prefixes, :func:`_job_store`) can differ: say so, and how the job keeps them together."""
    several = int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
    if not (several and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        return ""
    return (f". This is restart attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} of this node's agent; "
            "agents count restarts apart, and on a store they share the nodes' workers then wait apart: run torchrun "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so that each round has a store of its own")


def apply_timeout(groups: Iterable[dist.ProcessGroup], timeout: timedelta) -> None:
    """Give ``groups`` the same timeout as the default group (torch's subgroups get 30 minutes on gloo)."""
    for group in groups:
        _set_pg_timeout(timeout, group)


def check_same_on_all_ranks(device_type: str, layout: MeshLayout) -> None:
    """Fail loudly on every rank when ranks disagree on the mesh, before any group is built.

    Two small all_gathers: every rank's number of dims, then ``[ndim, sizes..., digest(device,
    names)]`` padded to the largest ndim, so meshes of any dimension are compared whole. Without
    it, mismatched shapes make torch's group creation hang or pair wrong ranks.
    """
    world = dist.get_world_size()
    if world == 1 or dist.get_backend() == "fake":
        return
    device = torch.device("cpu")
    if "cpu:" not in str(dist.get_backend_config()) and device_type != "cpu":
        device = torch.device(device_type, torch.get_device_module(device_type).current_device())

    def all_gather(row: list[int]) -> list[tuple[int, ...]]:
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
        return [tuple(r.tolist()) for r in rows]

    width = max(n for (n,) in all_gather([layout.ndim]))
    digest = int.from_bytes(
        hashlib.blake2b(repr((device_type, layout.dim_names)).encode(), digest_size=7).digest(), "little"
    )
    gathered = all_gather([layout.ndim, *layout.shape, *[0] * (width - layout.ndim), digest])
    if all(g == gathered[0] for g in gathered):
        return
    by_config: dict[tuple[int, ...], list[int]] = {}
    for r, g in enumerate(gathered):
        by_config.setdefault(g, []).append(r)
    summary = "; ".join(
        f"ranks {ranks} have shape {tuple(cfg[1 : 1 + cfg[0]])}" + (" (other dim names/device)" if cfg[-1] != digest else "")
        for cfg, ranks in by_config.items()
    )
    raise ValueError(
        f"ranks disagree on the mesh: rank {dist.get_rank()} asked for shape {layout.shape} with dim names "
        f"{layout.dim_names} on {device_type!r}, but {summary}. Every rank must call init_device_mesh "
        f"with the same arguments."
    )


#: torch's record of the default process group (``destroy_process_group`` sets its ``_default_pg`` to None, a new
#: ``init_process_group`` to the new group): read on every question of a mesh (:func:`check_world`), so read directly
#: (about 30 ns, where ``dist.is_initialized()`` and ``dist.group.WORLD`` take about 130 each)
C10D_WORLD = dist.distributed_c10d._world


def world_gone(world: dist.ProcessGroup | None) -> str | None:
    """How ``world``, the default process group a mesh was built on, is gone (destroyed, or destroyed and replaced by
    another), else None (also where there was none to keep)."""
    if world is None:
        return None
    if not dist.is_initialized():
        return "was destroyed (destroy_process_group())"
    if dist.group.WORLD is not world:
        return "was destroyed and replaced by another (init_process_group() since)"
    return None


def check_world(world: dist.ProcessGroup | None, layout: MeshLayout | None) -> None:
    """Raise where ``world`` (:func:`world_gone`), the process group of the mesh of ``layout``, is gone: every answer
    of that mesh would be of a world that is not."""
    if C10D_WORLD._default_pg is world or world is None:  # the fast answer: the mesh's world is the default one
        return
    how = world_gone(world)
    if how is not None:
        dims = ", ".join(f"{n}={s}" for n, s in zip(layout.dim_names, layout.shape)) if layout is not None else ""
        raise RuntimeError(f"the device mesh ({dims}) was built on a process group that {how}: its groups and ranks "
                           "are of that world, not of this one; call VESCALE_DEVICE_MESH.init_device_mesh(...) again "
                           "(is_initialized() is False until then)")
