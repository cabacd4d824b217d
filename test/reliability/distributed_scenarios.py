"""What each rank of test_distributed_faults.py's 4-rank gloo worlds does (process group timeout 3 s).

Scenarios run in order in one world; each returns what it saw, and the test asserts. A gloo
timeout closes the group's connections, so the scenario that times out comes last in its world.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vemesh import VESCALE_DEVICE_MESH, VeDeviceMesh, checkpoint

TIMEOUT = 3.0


def _outcome(fn) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        value = fn()
        return {"ok": True, "value": value, "s": time.perf_counter() - start}
    except Exception as e:  # noqa: BLE001 - reported back to pytest
        return {"ok": False, "type": type(e).__name__, "message": str(e), "s": time.perf_counter() - start,
                "trace": traceback.format_exc()}


def worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = nn.Linear(4, 4)
    # ranks pass different steps: every rank gets the same error, nothing is written
    out["different-steps"] = _outcome(lambda: checkpoint.save(Path(root) / "a", model=model, step=3 if rank == 2 else 2))
    # one rank built a different model: every rank names the entry, the two shapes and their ranks
    other = nn.Linear(4, 5) if rank == 3 else model
    out["different-shapes"] = _outcome(lambda: checkpoint.save(Path(root) / "c", model=other, step=1))
    # an 18-D mesh whose ranks differ in the 18th dim: found before any group is built
    names = tuple(f"d{i}" for i in range(18))
    shape = (1,) * 16 + ((2, 2) if rank % 2 else (4, 1))
    out["mesh-18d"] = _outcome(lambda: VeDeviceMesh().init_device_mesh("cpu", shape, mesh_dim_names=names))
    # save called on rank 0 only: rank 0 fails after the timeout, naming the others (last: a gloo
    # timeout closes the group's connections)
    if rank == 0:
        out["save-on-rank-0"] = _outcome(lambda: checkpoint.save(Path(root) / "b", model=model, step=1))
    else:
        time.sleep(2 * TIMEOUT)
    return out


def hung_worker(rank: int, world_size: int) -> dict[str, Any]:
    """A rank that stops responding in training: the others' collectives fail within the mesh's timeout."""
    out: dict[str, Any] = {}
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), timeout=TIMEOUT)
    if rank == 3:
        time.sleep(3 * TIMEOUT)
    else:
        out["hung-rank"] = _outcome(lambda: [dist.all_reduce(torch.ones(1), group=VESCALE_DEVICE_MESH.get_group(d)) for d in ("TP", "DP")])
    return out
