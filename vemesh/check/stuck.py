"""A rank of ``vemesh check``'s parallel run stuck in its step while its peers are done, named in seconds.

A step that runs a collective on some ranks only (a log line's all-reduce under ``if rank == 0``) hangs the ranks that
entered it, and the check waited out its ``--timeout`` (300 s by default) to report gloo's "Timed out waiting for recv
operation". Once one rank has written its record (its step, and every collective of its gradients, done), its peers
are at most a save behind it: :class:`Stalls` gives them :data:`FLOOR_S`, or :data:`TIMES` the time the first rank
took from the run's start, whichever is longer; a rank still running then has the stack of each of its threads written
by ``faulthandler`` (:func:`record_stacks`, on ``SIGUSR1``; written even while it waits inside gloo), and the run is
ended with the line of the user's code it waits at."""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

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


class Stalls:
    """Polled while the parallel run of ``world_size`` ranks writing into ``out`` runs (``processes``)."""

    def __init__(self, out: str, processes: list[Any], started: float) -> None:
        self.out, self.processes, self.started = out, processes, started
        self.first_done: float | None = None

    def poll(self) -> str | None:
        """Why the run is to end (the ranks stuck, and where), or None."""
        done = [r for r in range(len(self.processes)) if Path(self.out, f"rank{r}.pt").exists()]
        if not done:
            return None
        now = time.monotonic()
        if self.first_done is None:
            self.first_done = now
        late = [r for r, p in enumerate(self.processes) if r not in done and p.is_alive()
                and not Path(self.out, f"error{r}.json").exists()]
        allowed = max(FLOOR_S, TIMES * (self.first_done - self.started))
        if not late or now - self.first_done < allowed or not hasattr(signal, "SIGUSR1"):
            return None
        for r in late:
            os.kill(self.processes[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        where = "; ".join(f"rank {r} waits {_waits_at(Path(self.out, f'stack{r}.txt'))}" for r in late)
        return (f"rank(s) {late} did not finish the step {allowed:.0f} s after rank(s) {done} had: {where}. A "
                "collective that not every rank of its group runs (one under `if rank == 0:`, or a rank's extra "
                "micro-batch) waits for the others forever")


def _waits_at(stacks: Path) -> str:
    """Where the training thread of a rank's stack dump is: the innermost line of the user's code, and the
    torch.distributed function it is in, from faulthandler's text ("File "...", line N in NAME")."""
    try:
        text = stacks.read_text()
    except OSError:
        return "somewhere (its stack was not written)"
    threads = [t for t in re.split(r"\n(?=(?:Current thread|Thread) )", text) if "_worker" in t] or [text]
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', threads[0])  # the most recent call first
    user = next(((f, n, name) for f, n, name in frames if "/torch/" not in f and "/vemesh/" not in f
                 and "site-packages" not in f), None)
    inside = next((name for f, _, name in frames if "/torch/distributed/" in f), None)
    if user is None:
        return "outside your code" + (f" (in torch.distributed's {inside})" if inside else "")
    path = os.path.relpath(user[0])
    return (f"at {user[0] if path.startswith('..') else path}:{user[1]} in {user[2]}"
            + (f" (in torch.distributed's {inside})" if inside else " (not in a collective: in compute?)"))
