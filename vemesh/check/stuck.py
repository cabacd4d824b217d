"""A rank of ``vemesh check``'s parallel run stuck in its step while its peers are done, named in seconds.

A step that runs a collective on some ranks only (a log line's all-reduce under ``if rank == 0``) hangs the ranks that
entered it, and the check waited out its ``--timeout`` (300 s by default) to report gloo's "Timed out waiting for recv
operation". Once one rank has written its record (its step, and every collective of its gradients, done), its peers
are at most a save behind it: :class:`Stalls` gives them :data:`FLOOR_S`, or :data:`TIMES` the time the first rank
took from the run's start, whichever is longer; a rank still running then has the stack of each of its threads written
by ``faulthandler`` (:func:`record_stacks`, on ``SIGUSR1``; written even while it waits inside gloo), and the run is
ended with the line of the user's code it waits at. Where no rank finishes, every rank waiting in a torch.distributed
call whose stack has not moved in :data:`FLOOR_S` is a deadlock (collectives in another order on each rank), named
the same way; a rank in compute, however slow, is none."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from vemesh.planning.user_code import shown_path

__all__ = ["FLOOR_S", "TIMES", "Stalls", "record_stacks"]

#: the least a rank gets to finish after another has (on a loaded machine the OS may hold a rank back for seconds)
FLOOR_S = 20.0
#: and times what the first rank took from the start of the run, where that is longer
TIMES = 3.0
_FILES: list[Any] = []  # the stack files the handlers write to, open for the rank's life


def record_stacks(out: str, rank: int) -> None:
    """On ``SIGUSR1``, this rank writes every thread's Python stack to ``out/stack{rank}.txt``."""
    if not hasattr(signal, "SIGUSR1"):
        return
    f = open(os.path.join(out, f"stack{rank}.txt"), "w")  # noqa: SIM115 -- kept open: faulthandler writes to it
    _FILES.append(f)
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    Path(out, f"stack{rank}.ready").touch()  # from now on SIGUSR1 dumps, no longer ends the process (its default)


class Stalls:
    """Polled while the parallel run of ``world_size`` ranks writing into ``out`` runs (``processes``)."""

    def __init__(self, out: str, processes: list[Any], started: float) -> None:
        self.out, self.processes, self.started = out, processes, started
        self.first_done: float | None = None
        self.sampled: tuple[float, dict[int, list]] | None = None  # the last sample of every waiting rank's stack

    def poll(self) -> str | None:
        """Why the run is to end (the ranks stuck, and where), or None."""
        if not hasattr(signal, "SIGUSR1"):
            return None
        done = [r for r in range(len(self.processes)) if Path(self.out, f"rank{r}.pt").exists()]
        now = time.monotonic()
        live = [r for r, p in enumerate(self.processes) if r not in done and p.is_alive()
                and not Path(self.out, f"error{r}.json").exists()]
        if not done:
            return self._deadlocked(live, now)
        if self.first_done is None:
            self.first_done = now
        allowed = max(FLOOR_S, TIMES * (self.first_done - self.started))
        if not live or now - self.first_done < allowed:
            return None
        where = "; ".join(f"rank {r} waits {_waits_at(frames)}" for r, frames in self._stacks(live).items())
        return (f"rank(s) {live} did not finish the step {allowed:.0f} s after rank(s) {done} had: {where}. A "
                "collective that not every rank of its group runs (one under `if rank == 0:`, or a rank's extra "
                "micro-batch) waits for the others forever")

    def _deadlocked(self, live: list[int], now: float) -> str | None:
        """With no rank done: every live rank in a torch.distributed call, its stack the same as :data:`FLOOR_S`
        earlier (a rank in compute, however slow, is no deadlock); sampled every :data:`FLOOR_S` from then on."""
        if not live or now - max(self.started, self.sampled[0] if self.sampled else 0.0) < FLOOR_S:
            return None
        stacks, before = self._stacks(live), self.sampled
        self.sampled = (now, stacks)
        if before is None or len(stacks) < len(live) or any(
                not frames or frames != before[1].get(r) or "/torch/distributed/" not in frames[0][0]
                for r, frames in stacks.items()):
            return None
        where = "; ".join(f"rank {r} waits {_waits_at(frames)}" for r, frames in stacks.items())
        return (f"no rank finished the step, and every rank ({live}) has waited in the same torch.distributed call "
                f"for {now - before[0]:.0f} s: {where}. Collectives in another order on each rank, or one that some "
                "rank of its group never runs, wait for each other forever")

    def _stacks(self, ranks: list[int]) -> dict[int, list]:
        """Each rank's training thread's frames now, the most recent first (``faulthandler``'s dump on
        ``SIGUSR1``: each dump is appended to the rank's file, read from where the last ended)."""
        ranks = [r for r in ranks if Path(self.out, f"stack{r}.ready").exists()]
        sizes = {r: _size(Path(self.out, f"stack{r}.txt")) for r in ranks}
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.processes[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        return {r: _frames(Path(self.out, f"stack{r}.txt"), sizes[r]) for r in ranks}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _frames(stacks: Path, start: int) -> list[tuple[str, str, str]]:
    """The frames of the training thread in faulthandler's dump from ``start`` on ("File "...", line N in NAME"),
    the most recent call first; [] where none was written."""
    try:
        with open(stacks, errors="replace") as f:
            f.seek(start)
            text = f.read()
    except OSError:
        return []
    threads = [t for t in re.split(r"\n(?=(?:Current thread|Thread) )", text) if "_worker" in t] or [text]
    return re.findall(r'File "([^"]+)", line (\d+) in (\S+)', threads[0])


def _waits_at(frames: list[tuple[str, str, str]]) -> str:
    """Where a rank's frames are: the innermost line of the user's code, and the torch.distributed function it is
    in."""
    if not frames:
        return "somewhere (its stack was not written)"
    user = next(((f, n, name) for f, n, name in frames if "/torch/" not in f and "/vemesh/" not in f
                 and "site-packages" not in f), None)
    inside = next((name for f, _, name in frames if "/torch/distributed/" in f), None)
    if user is None:
        return "outside your code" + (f" (in torch.distributed's {inside})" if inside else "")
    return (f"at {shown_path(user[0])}:{user[1]} in {user[2]}"
            + (f" (in torch.distributed's {inside})" if inside else " (not in a collective: in compute?)"))
