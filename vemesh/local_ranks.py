"""Starting N ranks on this machine from a running program: ``vemesh check``'s parallel run, ``vemesh calibrate``.

:func:`start` is torch's :func:`torch.multiprocessing.start_processes` with spawn's semantics (the function and its
arguments travel by name and pickle; each rank gets the caller's ``sys.path``, working directory and, here, its
environment as it is at the call), but torch is imported once: where the system has it, a forkserver whose server
imports torch (and what ``preload`` names) when a program first starts ranks, and forks each rank from there. Under
spawn every rank imports torch anew, several seconds of CPU each, all at once on the user's cores (four checks of
test_check.py on 2 cores: 34 s of CPU and 18 s by spawn, 14 s and 12 s by forkserver).

The server lives as long as the program and serves its later calls; what it imported stays as imported then (an
environment variable torch reads at import, such as ``TORCH_LOGS``, is the program's when it first started ranks).
:func:`libraries_of` names what else it can import once: the installed libraries the user's code uses (Hugging Face
transformers is 2.5 s of CPU a rank; the checks of test_check.py on 2 cores took 159 s with each rank importing it,
63 s with the server importing it once).
"""

from __future__ import annotations

import multiprocessing
import os
import site
import sys
import sysconfig
import time
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["PRELOAD", "discard_error_files", "libraries_of", "method", "start"]

#: what the server imports once for every rank it starts (torch._dynamo: torch imports it on an optimizer's first
#: step, 1 to 1.5 s a process)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo")


def method() -> str:
    """The start method :func:`start` uses here: ``"forkserver"`` where the system has it, else ``"spawn"`` (a queue
    the ranks write to is made in its context: ``multiprocessing.get_context(method()).Queue()``)."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def start(fn: Callable[..., None], args: tuple, nprocs: int, *, join: bool, preload: Sequence[str] = ()) -> Any:
    """``fn(rank, *args)`` in ``nprocs`` new processes: torch's ``start_processes`` (its ``ProcessContext``, or None
    with ``join``), by forkserver where the system has one, else by spawn. With ``join``, a rank's error file is
    removed once read; without, the caller's :func:`discard_error_files` removes them once it has joined."""
    context = _started(fn, args, nprocs, preload)
    if not join:
        return context
    try:
        while not context.join():
            pass
    finally:
        discard_error_files(context)
    return None


def discard_error_files(context: Any) -> None:
    """Remove the files in which torch's ranks write the traceback of an exception (``pytorch-errorfile-*.pickle``
    in the temporary directory), once the ranks are joined: torch's ``join`` reads a rank's and leaves it, so each
    failed run of ``vemesh check`` left one a failed rank in ``/tmp``."""
    for path in context.error_files:
        try:
            os.remove(path)
        except FileNotFoundError:  # written only by a rank that raised
            pass


def _started(fn: Callable[..., None], args: tuple, nprocs: int, preload: Sequence[str]) -> Any:
    import torch.multiprocessing as mp

    how = method()
    if how == "forkserver":  # no effect once the server runs: it keeps what it imported
        multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, *preload])

    def started() -> Any:
        return mp.start_processes(_rank, args=(fn, dict(os.environ), args), nprocs=nprocs, join=False,
                                  start_method=how)

    try:
        return started()
    except (EOFError, ConnectionError):  # the server stopped before forking a rank
        if how != "forkserver" or not preload:
            raise
    # Python's server passes over a module whose import raises ImportError, and stops at any other error (it printed
    # the module's traceback above): started again without ``preload``, each rank imports those modules itself
    roots = sorted({name.partition(".")[0] for name in preload})
    warnings.warn(f"the ranks' server stopped at an error importing {', '.join(roots)} (above); each rank imports "
                  "it itself", RuntimeWarning, stacklevel=3)
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    for wait in (0.1, 0.2, 0.5, 1, 2, 4):  # started again once it has exited: until then its socket refuses
        try:
            return started()
        except (EOFError, ConnectionError):
            time.sleep(wait)
    return started()


def libraries_of(functions: Iterable[Any]) -> list[str]:
    """The modules of installed libraries that the modules of ``functions`` use (a module, or a class or function of
    one, among their globals), as far as this process has imported them, in the order it imported them: what every
    rank would import anew. Not the user's own modules (not installed: running them in the server would run their
    top-level code there), nor the standard library's, vemesh's or torch's (:data:`PRELOAD`)."""
    roots: set[str] = set()
    for fn in functions:
        scope = getattr(fn, "__globals__", None)
        if scope is None:  # a class or another callable: its module's globals
            scope = vars(sys.modules.get(getattr(fn, "__module__", None) or "", types.ModuleType("_")))
        for value in list(scope.values()):
            try:  # a lazy proxy may raise more than AttributeError when asked
                name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            except Exception:
                continue
            if isinstance(name, str) and name:
                roots.add(name.partition(".")[0])
    roots -= {"vemesh", "__main__", *(p.partition(".")[0] for p in PRELOAD)}
    roots = {r for r in roots if _installed(sys.modules.get(r))}
    return [m for m, v in list(sys.modules.items()) if v is not None and m.partition(".")[0] in roots]


def _installed(module: types.ModuleType | None) -> bool:
    """Whether ``module`` (a top-level one) lies in an installed packages' directory (site-packages)."""
    file = getattr(module, "__file__", None)
    if not file:
        return False
    dirs = {*site.getsitepackages(), site.getusersitepackages(), *(sysconfig.get_paths()[k] for k in ("purelib",
                                                                                                       "platlib"))}
    return any(Path(file).is_relative_to(d) for d in dirs if d)


def _rank(rank: int, fn: Callable[..., None], env: dict[str, str], args: tuple) -> None:
    """One rank: the caller's environment as it was at the call (a forked rank inherits the server's), then ``fn``."""
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)
