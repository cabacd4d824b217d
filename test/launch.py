"""Run a function (``run_ranks``) or a program's ``main`` (``run_main``) on N real gloo ranks, one process each,
with a hard timeout.

``run_ranks``' rendezvous goes through a file; ``run_main``'s through a store on a port the system picks. So no
port is ever guessed or shared. The function must live at module level in an importable module (spawn pickles it
by name). Each rank's return value comes back to the caller; a rank's
exception is re-raised in the caller with that rank's traceback, and a
run that outlives ``timeout`` is killed rather than left to hang the suite.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import multiprocessing.connection
import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank raised; the message carries every failing rank's traceback."""


def free_port() -> int:
    """A port nothing listens on now (the system's pick), for a server started by hand: a lighthouse, torchrun's
    rendezvous endpoint."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


# What the server imports once for every rank it starts. torch._dynamo: torch imports it lazily on the first call
# of an optimizer's step or zero_grad (1 to 1.5 s a process). train: the GPT example, when examples/gpt is on the
# path (the example's tests put it there); a module that is not found is skipped by the server. transformers: the
# library models' ranks (2.5 s of CPU a rank; test/conftest.py gives vemesh.local_ranks' server the same).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "vemesh", "launch", "train",
           "transformers", "transformers.modeling_utils"]


def _context() -> Any:
    """A forkserver whose server has imported torch once: each rank then starts in a fraction of a second
    instead of importing torch again (about 4 s of CPU a process on this project's machines). Spawn semantics
    otherwise: the function and its arguments travel by name and pickle. One server per test process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
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


def _main_worker(rank: int, world_size: int, port: int, module: str, argv: list[str], env: dict, cwd: str,
                 path: str | None, outs: tuple[str, str]) -> None:
    """One rank of ``start_main``: torchrun's environment for this rank, stdout and stderr appended to ``outs``,
    ``module.main(argv)``'s return value as the exit code."""
    os.environ.clear()  # the server's environment is the one it started with: this run's is passed whole
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", ROLE_RANK=str(rank),
                      ROLE_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")  # every rank a client of the launcher's store, as torchrun's
    for fd, name in zip((1, 2), outs):
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(out, fd)
        os.close(out)
    sys.stdout.reconfigure(line_buffering=True)  # what a killed rank printed is kept
    sys.stderr.reconfigure(line_buffering=True)
    os.chdir(cwd)
    if path and path not in sys.path:
        sys.path.insert(0, path)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # the server imported torch before this env
    code = 1
    try:
        sys.argv = [module, *argv]
        main = importlib.import_module(module).main
        code = main(argv) if inspect.signature(main).parameters else main()  # a main() that reads sys.argv itself
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # as the example's own __main__: no interpreter teardown beside gloo's threads


class Ranks:
    """The ranks :func:`start_main` started, as torchrun's process is to its caller: ``poll``, ``wait``, ``kill``.

    torchrun's failure rule: once a rank has failed, the others are killed ``grace`` seconds later (at the next
    ``poll``); the job's code is the first failed rank's. ``stopped`` says the caller killed it.
    """

    def __init__(self, procs: list[Any], store: Any, args: list[str], grace: float) -> None:
        self.procs, self._store, self.args, self.grace = procs, store, args, grace
        self.failed_at: float | None = None
        self.first_failure = 0
        self.stopped = False

    def poll(self) -> int | None:
        failed = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
        if failed and self.failed_at is None:
            self.failed_at, self.first_failure = time.monotonic(), failed[0]
        if self.failed_at is not None and time.monotonic() >= self.failed_at + self.grace:
            self._kill()
        if any(p.is_alive() for p in self.procs):
            return None
        for p in self.procs:
            p.join()
        return self.first_failure or next((c for c in self.codes if c != 0), 0)

    @property
    def returncode(self) -> int | None:
        """As ``Popen.returncode``: None while it runs."""
        return self.poll()

    @property
    def codes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]

    def wait(self, timeout: float | None = None) -> int:
        """The job's exit code; ``subprocess.TimeoutExpired`` if it is still running after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            alive = [p.sentinel for p in self.procs if p.is_alive()]
            multiprocessing.connection.wait(alive, timeout=0.2)
        return code

    def kill(self) -> None:
        """SIGKILL every rank at once (a lost host), and reap them."""
        self.stopped = True
        self._kill()
        for p in self.procs:
            p.join(timeout=5)

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()


def start_main(module: str, argv: list[str], world_size: int, *, outs: Callable[[int], tuple[str, str]],
               env: dict | None = None, cwd: str | None = None, path: str | None = None, grace: float = 3.0) -> Ranks:
    """``torchrun --standalone --nproc_per_node=world_size`` for a module with ``main(argv) -> int`` (or a ``main()``
    that reads ``sys.argv``), from this process's forkserver: torch, vemesh and the module are imported once per test
    process, not once per rank. Returns at once.

    torchrun's environment and store (every rank a client of a store this process serves) and its failure rule
    (:class:`Ranks`). ``outs(rank)`` names the files a rank appends its stdout and stderr to (one file for both, and
    for every rank, as torchrun's output is). ``path``: a directory the ranks import ``module`` from.
    The tests that are about torchrun itself (restarts, rendezvous, its handling of a failed rank) launch it.
    """
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timedelta(seconds=60), wait_for_workers=False)
    run_env = dict(os.environ, **(env or {}))
    procs = [ctx.Process(target=_main_worker, daemon=True,
                         args=(r, world_size, store.port, module, list(argv), run_env, cwd or os.getcwd(), path, outs(r)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    return Ranks(procs, store, [module, *argv], grace)


@dataclass
class MainRun:
    returncode: int  # 0 when every rank returned 0, else the code of the rank that failed first
    codes: list[int | None]  # each rank's exit code
    stdout: str  # every rank's stdout, rank 0 first
    stderr: str
    stopped: bool = False  # stopped by ``until``, not ended


def run_main(module: str, argv: list[str], world_size: int, *, env: dict | None = None, cwd: str | None = None,
             path: str | None = None, timeout: float = 240.0, grace: float = 3.0,
             until: Callable[[str], bool] | None = None) -> MainRun:
    """:func:`start_main`, waited for: every rank's stdout and stderr, rank 0 first. Raises TimeoutError, with what
    the ranks printed, when the run outlives ``timeout`` (every rank is killed first). ``until``: stop every rank
    once it holds for what rank 0 has printed so far (``stopped`` is then True)."""
    with tempfile.TemporaryDirectory() as out_dir:
        def outs(rank: int) -> tuple[str, str]:
            return os.path.join(out_dir, f"{rank}.out"), os.path.join(out_dir, f"{rank}.err")

        def read(name: str) -> str:
            files = [Path(out_dir, f"{r}.{name}") for r in range(world_size)]
            return "".join(f.read_text(errors="replace") for f in files if f.exists())

        ranks = start_main(module, argv, world_size, outs=outs, env=env, cwd=cwd, path=path, grace=grace)
        deadline, first = time.monotonic() + timeout, Path(out_dir, "0.out")
        timed_out = False
        while ranks.poll() is None:
            if until is not None and first.exists() and until(first.read_text(errors="replace")):
                ranks.kill()
                break
            if time.monotonic() > deadline:
                timed_out = True
                ranks.kill()
                break
            multiprocessing.connection.wait([p.sentinel for p in ranks.procs if p.is_alive()], timeout=0.2)
        code = ranks.poll()
        stdout, stderr = read("out"), read("err")
    if timed_out:
        raise TimeoutError(f"{module} on {world_size} ranks did not finish within {timeout:.0f}s; exit codes "
                           f"{ranks.codes}\n--- stdout ---\n{stdout[-3000:]}\n--- stderr ---\n{stderr[-3000:]}")
    return MainRun(0 if ranks.stopped else code, ranks.codes, stdout, stderr, ranks.stopped)


ROOT = Path(__file__).resolve().parents[1]


def launch_script(script: Path, argv: list[str], procs: int, cwd: str) -> tuple[int, str, str]:
    """``bench/plan_accuracy.py``'s ``launch`` for the tests: ``script``'s ``main`` on ``procs`` ranks by
    :func:`run_main` instead of torchrun; (exit code, stdout, stderr)."""
    run = run_main(Path(script).stem, argv, procs, cwd=cwd, path=str(Path(script).parent),
                   env={"OMP_NUM_THREADS": "1"}, timeout=400)
    return run.returncode, run.stdout, run.stderr


def plan_here(args: list[str]) -> dict[str, Any]:
    """``bench/plan_accuracy.py``'s ``plan`` for the tests: ``vemesh plan ARGS --json`` in this process, from the
    repository's root."""
    from vemesh.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *args, "--json"])
    if code:
        raise RuntimeError(f"vemesh plan {' '.join(args)} exited with {code}: {err.getvalue()[-3000:]}")
    return json.loads(out.getvalue())
