"""Live fault tolerance on real processes: a torchft lighthouse and replica groups of the GPT example.

Shared by ``test_gpt_live_ft.py`` and ``bench/fault_recovery.py``. Every process is started in its own
session, so a replica (torchrun and its workers) is killed as a whole, as a lost host would be.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from launch import free_port

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "gpt" / "train.py"

#: A small job: 2 layers, TP=2 inside each replica, 8 sequences per step split over the replicas.
TINY = ["--n-layer", "2", "--n-embd", "64", "--seq-len", "64", "--global-batch-size", "8", "--max-data-bytes", "400000",
        "--sample-tokens", "0", "--eval-every", "0", "--eval-batches", "1", "--log-every", "1", "--micro-batch-size", "4"]


def env() -> dict[str, str]:
    out = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHFT_LIGHTHOUSE"):
        out.pop(key, None)
    return out


def spawn(cmd: list[str], log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own, stdout and stderr into ``log``."""
    return subprocess.Popen(cmd, cwd=REPO, env={**env(), **(extra_env or {})}, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (torchrun puts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every worker under it at once (or every rank of a :func:`replica`), as a lost host would
    go."""
    if not isinstance(proc, subprocess.Popen):
        proc.kill()
        return
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


@contextmanager
def lighthouse(tmp: Path, heartbeat_ms: int = 5000, join_ms: int = 1000):
    """A torchft lighthouse on a free port; yields its address. The heartbeat timeout is torchft's own default: on the
    suite's loaded cores a live replica's heartbeat came over 1 s late, and the lighthouse left it out of a quorum
    (CI's live FT run: step 100 taken by replica 1 alone, replica 0 healed from it at step 101)."""
    port = free_port()
    binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) or "torchft_lighthouse"
    proc = spawn([binary, "--min_replicas", "1", "--bind", f"[::]:{port}", "--heartbeat_timeout_ms",
                  str(heartbeat_ms), "--join_timeout_ms", str(join_ms)], tmp / "lighthouse.log")
    try:
        listening(proc, port, tmp / "lighthouse.log")
        yield f"http://localhost:{port}"
    finally:
        kill(proc)


def listening(proc: subprocess.Popen, port: int, log: Path, timeout: float = 120.0) -> None:
    """Return once ``proc`` accepts connections on ``port``; fail if it exits first or does not within ``timeout``.

    ``torchft_lighthouse`` imports torchft, and so torch, before it binds: on the suite's loaded cores that took over
    10 s, and a replica started at once (from the forkserver, torch already imported) was refused for its whole
    ``--ft-timeout-s 10`` and exited (``test_a_lighthouse_lost_mid_run_stops_the_replica_within_the_timeout``, with
    6 pytest workers on 2 cores)."""
    end = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            return
        except OSError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.returncode} before listening on {port}: "
                                 f"{log.read_text()[-2000:]}")
        if time.monotonic() > end:
            raise AssertionError(f"{proc.args} was not listening on {port} within {timeout:.0f}s")
        time.sleep(0.05)


def torchrun(args: list[str], log: Path, nproc: int = 2, torchrun_args: list[str] = ()) -> subprocess.Popen:
    """``torchrun --nproc_per_node=nproc [torchrun_args] train.py args`` on its own rendezvous port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master-port={free_port()}",
           *torchrun_args, str(TRAIN), *args]
    return spawn(cmd, log)


def replica(args: list[str], log: Path, nproc: int = 2):
    """``torchrun --nproc_per_node=nproc train.py args`` for the tests: the example's ranks in torchrun's environment
    from the test process's forkserver (``launch.start_main``; no interpreter started per rank), every rank's output
    into ``log``. :func:`kill` kills them at once, as a lost host."""
    from launch import start_main

    return start_main("train", args, nproc, outs=lambda rank: (str(log), str(log)), env=env(), cwd=str(REPO),
                      path=str(TRAIN.parent))


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def wait_for(path: Path, step: int, timeout: float, procs: list[subprocess.Popen] = ()) -> list[dict]:
    """Poll ``path`` until it records ``step``; fail if it does not within ``timeout`` or a process ends first."""
    return wait_until(path, lambda row: row["step"] >= step, f"step {step}", timeout, procs)


def wait_until(path: Path, where: Any, what: str, timeout: float, procs: list[subprocess.Popen] = ()) -> list[dict]:
    """Poll ``path`` until one of its records is ``where(record)`` (``what``, for the failure); fail if none is within
    ``timeout`` or a process ends first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rows = records(path)
        if any(where(row) for row in rows):
            return rows
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args} exited with {p.returncode} before {path.name} recorded {what}")
        time.sleep(0.05)
    raise AssertionError(f"{path.name} recorded no {what} within {timeout:.0f}s: {records(path)[-1:]}")
