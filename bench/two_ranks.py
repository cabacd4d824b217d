"""Run a benchmark function on N gloo ranks started from this script (2 by default); return rank 0's result.

Shared by ``bench/pipeline_schedules.py``, ``bench/checkpoint_io.py``, ``bench/context_parallel.py``,
``bench/expert_parallel.py`` and ``bench/fused_tp.py``: the ranks start as ``vemesh check``'s do
(:func:`vemesh.local_ranks.start`: forked from a server that imported torch once, spawn where there is none), and each
gets one thread, a file rendezvous (no port to pick) and a 5-minute process group timeout.
"""
from __future__ import annotations

import multiprocessing
import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vemesh import local_ranks

__all__ = ["run_on_ranks", "run_on_two_ranks"]


def _worker(rank: int, world: int, init_file: str, fn: Callable[..., Any], args: tuple, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=5))
    try:
        result = fn(*args)
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def run_on_ranks(world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on ``world`` ranks (``fn`` lives at module level, so the worker can find it); rank 0's return value."""
    out = multiprocessing.get_context(local_ranks.method()).Queue()
    with tempfile.TemporaryDirectory() as tmp:
        local_ranks.start(_worker, (world, os.path.join(tmp, "rdzv"), fn, args, out), world, join=True)
    return out.get(timeout=10)


def run_on_two_ranks(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on ranks 0 and 1; rank 0's return value."""
    return run_on_ranks(2, fn, *args)
