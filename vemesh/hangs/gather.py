"""The one module of :mod:`vemesh.hangs` that communicates: the straggler summary, gathered over the world.

Every rank calls :func:`straggler_summary` at the same point (it runs ``all_gather_object``); everything else in
:mod:`vemesh.hangs` reads this process's recorder or files, or talks through the job's store only.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from vemesh.hangs.dumps import Job, rank_dump
from vemesh.hangs.record import recorder_json
from vemesh.hangs.stragglers import stragglers


def straggler_summary(describe: Callable[[], dict[str, Any]], steps: Sequence[tuple[int, int]],
                       since_ns: int = 0) -> str | None:
    """Every rank calls it (one ``all_gather_object`` over the world): per dim, who was last into the collectives
    entered since ``since_ns``, as one line on rank 0 (None elsewhere). The recorder must be on; ``steps`` are this
    rank's marked ``(time_ns, step)``."""
    fr = recorder_json(True)
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) <= 0:
        raise RuntimeError("straggler summaries read torch's Flight Recorder, which is off: set VEMESH_HANG_DIR or "
                           "TORCH_FR_BUFFER_SIZE in the environment before the first collective")
    fr["entries"] = [e for e in fr.get("entries", []) if int(e.get("time_created_ns", 0)) >= since_ns]
    mine = {"rank": dist.get_rank(), "host": socket.gethostname(), "flight_recorder": fr, "mesh": describe(),
            "steps": [s for s in steps if s[0] >= since_ns - 10**10]}
    docs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(docs, mine)
    if dist.get_rank() != 0:
        return None
    job = Job({d["rank"]: rank_dump(d) for d in docs}, None, len(docs))
    found = [d.line() for d in stragglers(job) if d.dim != "world"]
    return "stragglers: " + ("; ".join(found) if found else "no collective recorded by every member of its group")
