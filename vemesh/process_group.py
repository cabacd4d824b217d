"""Bring up the default process group for a mesh, and check that every rank asks for the same mesh.

Kept apart from :mod:`vemesh.mesh` so the mesh manager reads as queries only. Everything
here runs once per ``init_device_mesh``.
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist

from .layout import MeshLayout

__all__ = ["check_same_on_all_ranks", "ensure_process_group"]


def ensure_process_group(device_type: str) -> None:
    """Create the default process group if there is none: torchrun's env, or one local rank."""
    if dist.is_initialized():
        return
    accel = dist.Backend.default_device_backend_map.get(device_type)
    backend = "gloo" if device_type == "cpu" or accel is None else f"cpu:gloo,{device_type}:{accel}"
    if "WORLD_SIZE" in os.environ or "RANK" in os.environ:
        store = _restart_scoped_store()
        if store is None:
            dist.init_process_group(backend)
        else:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    else:  # a plain `python script.py`: one rank, no rendezvous needed
        dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())


def _restart_scoped_store() -> dist.Store | None:
    """torchrun's shared store with this restart attempt's keys kept apart, or None for torch's default.

    torch 2.13's torchrun keeps one TCPStore per node for the whole job and hands it to the
    workers it restarts (``--max-restarts``), but its env:// rendezvous no longer prefixes keys
    per attempt; a restarted worker then reads the previous attempt's keys and fails with
    "Gloo connectFullMesh failed ... Connection refused". Prefixing with
    ``TORCHELASTIC_RESTART_COUNT`` (the same on every worker of an attempt) keeps each apart.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    return dist.PrefixStore(f"/vemesh/attempt_{restart}", store)


_CHECK_SLOTS = 16  # mesh sizes carried by the cross-rank check, beyond ndim and a name digest


def check_same_on_all_ranks(device_type: str, layout: MeshLayout) -> None:
    """Fail loudly on every rank when ranks disagree on the mesh, before any group is built.

    One all_gather of a small int64 row per rank: ``[ndim, sizes..., digest(device, names)]``.
    Without it, mismatched shapes make torch's group creation hang or pair wrong ranks.
    """
    world = dist.get_world_size()
    if world == 1 or dist.get_backend() == "fake":
        return
    digest = int.from_bytes(
        hashlib.blake2b(repr((device_type, layout.dim_names)).encode(), digest_size=7).digest(), "little"
    )
    row = [layout.ndim, *layout.shape[:_CHECK_SLOTS]] + [0] * max(0, _CHECK_SLOTS - layout.ndim) + [digest]
    device = torch.device("cpu")
    if "cpu:" not in str(dist.get_backend_config()) and device_type != "cpu":
        device = torch.device(device_type, torch.get_device_module(device_type).current_device())
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    gathered = [tuple(r.tolist()) for r in rows]
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
