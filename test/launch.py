"""Run a function on N real gloo ranks, one process each, with a hard timeout.

Rendezvous goes through a file, so no port is ever picked or shared. The
function must live at module level in an importable module (spawn pickles it
by name). Each rank's return value comes back to the caller; a rank's
exception is re-raised in the caller with that rank's traceback, and a
run that outlives ``timeout`` is killed rather than left to hang the suite.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank raised; the message carries every failing rank's traceback."""


def _worker(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple, env: dict, out: Any,
            pg_timeout: float = 60.0) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
        )
        result = fn(rank, world_size, *args)
        out.put((rank, True, result))
    except BaseException:  # report everything, including SystemExit from a bad config
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context() -> Any:
    """A forkserver whose server has imported torch once: each rank then starts in a fraction of a second
    instead of importing torch again (about 2 s a process on this project's machines). Spawn semantics
    otherwise: the function and its arguments travel by name and pickle."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "launch"])
    return ctx


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, env: dict | None = None, pg_timeout: float = 60.0
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    ``pg_timeout`` is the process group's own timeout (how long a collective waits).
    """
    ctx = _context()
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, dict(env or {}), out, pg_timeout), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, tuple[bool, Any]] = {}
        wait = timeout
        try:
            while len(results) < world_size:
                try:
                    rank, ok, value = out.get(timeout=wait)
                except queue.Empty:
                    if any(not ok for ok, _ in results.values()):
                        break  # the others are stuck in a collective the failed rank never joined
                    missing = sorted(set(range(world_size)) - set(results))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s") from None
                results[rank] = (ok, value)
                if not ok:
                    wait = min(wait, 10.0)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    failed = {r: v for r, (ok, v) in sorted(results.items()) if not ok}
    if failed:
        raise RankFailed("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items()))
    return [results[r][1] for r in range(world_size)]
