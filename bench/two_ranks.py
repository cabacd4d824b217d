"""Run a benchmark function on N gloo ranks spawned from this script (2 by default); return rank 0's result.

Shared by ``bench/pipeline_schedules.py``, ``bench/checkpoint_io.py`` and ``bench/context_parallel.py``: each
rank gets one thread, a file rendezvous (no port to pick) and a 5-minute process group timeout.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
    ctx = mp.get_context("forkserver")  # spawn semantics, but torch is imported once, in the server
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor"])
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "rdzv"), fn, args, out), nprocs=world,
                           start_method="forkserver")
    return out.get(timeout=10)


def run_on_two_ranks(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on ranks 0 and 1; rank 0's return value."""
    return run_on_ranks(2, fn, *args)
