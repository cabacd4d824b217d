"""Starting N ranks on this machine from a running program: ``vemesh check``'s parallel run, ``vemesh calibrate``.

:func:`start` is torch's :func:`torch.multiprocessing.start_processes` with spawn's semantics (the function and its
arguments travel by name and pickle; each rank gets the caller's ``sys.path``, working directory and, here, its
environment as it is at the call), but torch is imported once: where the system has it, a forkserver whose server
imports torch (and what ``preload`` names) when a program first starts ranks, and forks each rank from there. Under
spawn every rank imports torch anew, several seconds of CPU each, all at once on the user's cores (four checks of
test_check.py on 2 cores: 34 s of CPU and 18 s by spawn, 14 s and 12 s by forkserver).

The server lives as long as the program and serves its later calls; what it imported stays as imported then (an
environment variable torch reads at import, such as ``TORCH_LOGS``, is the program's when it first started ranks).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PRELOAD", "method", "start"]

#: what the server imports once for every rank it starts (torch._dynamo: torch imports it on an optimizer's first
#: step, 1 to 1.5 s a process)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo")


def method() -> str:
    """The start method :func:`start` uses here: ``"forkserver"`` where the system has it, else ``"spawn"`` (a queue
    the ranks write to is made in its context: ``multiprocessing.get_context(method()).Queue()``)."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def start(fn: Callable[..., None], args: tuple, nprocs: int, *, join: bool, preload: Sequence[str] = ()) -> Any:
    """``fn(rank, *args)`` in ``nprocs`` new processes: torch's ``start_processes`` (its ``ProcessContext``, or None
    with ``join``), by forkserver where the system has one, else by spawn."""
    import torch.multiprocessing as mp

    how = method()
    if how == "forkserver":  # no effect once the server runs: it keeps what it imported
        multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, *preload])
    return mp.start_processes(_rank, args=(fn, dict(os.environ), args), nprocs=nprocs, join=join, start_method=how)


def _rank(rank: int, fn: Callable[..., None], env: dict[str, str], args: tuple) -> None:
    """One rank: the caller's environment as it was at the call (a forked rank inherits the server's), then ``fn``."""
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)
