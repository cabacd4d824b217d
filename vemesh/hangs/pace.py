"""The job's pace, for the hang watch: when a wait is long for *this* job, and whether the ranks have stopped.

With ``VEMESH_HANG_AFTER`` unset, a collective is a *suspect* once it has waited :func:`threshold` seconds: the
conservative threshold (half the collective timeout) until the warm-up is over, then ``PACE_FACTOR`` times the
recent p99 step time (from ``mark_step``), never under ``FLOOR_S``. A suspect is a hang only when every other rank has
stopped as long: no step and no finished collective for that long, and none in a declared pause (its heartbeat says
so, :class:`Progress`). A rank that still moves, only slower, keeps the job's pace slow with it and is no hang.

Pure arithmetic on the marks and the heartbeats' text: no store, no torch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

__all__ = ["FLOOR_S", "PACE_FACTOR", "WARMUP_STEPS", "Progress", "step_pace", "threshold"]

#: marked steps before the pace is trusted: the first intervals (compilation, the first loads) are left out, and
#: enough after them are needed to say what a step takes
WARMUP_STEPS = 10
_SKIPPED = 3
#: a wait longer than this many p99 steps is a suspect
PACE_FACTOR = 5.0
#: never a suspect before this many seconds (a step of a few ms would make the threshold a few ms)
FLOOR_S = 4.0


def step_pace(steps: Sequence[tuple[int, int]], recent: int = 100) -> float | None:
    """The p99 of the last ``recent`` step intervals, in seconds, after the warm-up; None during the warm-up.

    ``steps`` are ``(time_ns, step)`` marks, oldest first."""
    if len(steps) < WARMUP_STEPS:
        return None
    marks = list(steps)[_SKIPPED:][-(recent + 1):]
    gaps = sorted((b[0] - a[0]) / 1e9 for a, b in zip(marks, marks[1:]))
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None


def threshold(steps: Sequence[tuple[int, int]], conservative: float) -> tuple[float, bool]:
    """``(seconds, paced)``: the pace's threshold after the warm-up (capped by the conservative one), else the
    conservative threshold."""
    pace = step_pace(steps)
    if pace is None:
        return conservative, False
    return min(conservative, max(FLOOR_S, PACE_FACTOR * pace)), True


class Progress:
    """This rank's progress for its heartbeat: when its step or its finished collectives last changed, and whether
    it is in a declared pause (:meth:`paused`; vemesh's checkpoints declare theirs)."""

    def __init__(self) -> None:
        self._seen: tuple[int, int] | None = None
        self.moved = time.time()
        self._pauses = 0
        self._lock = threading.Lock()

    def update(self, step: int, finished: int) -> None:
        now = (step, finished)
        if now != self._seen:
            self._seen, self.moved = now, time.time()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A stretch in which this rank may not move for long (an evaluation on one rank, a checkpoint): while it
        lasts no rank calls the wait on it a hang by the pace (the conservative threshold still holds)."""
        with self._lock:
            self._pauses += 1
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1
            self.moved = time.time()  # the pause's end is a move: the wait starts over

    def beat(self) -> str:
        """The heartbeat's text: ``now|last move|paused``."""
        return f"{time.time()!r}|{self.moved!r}|{int(self._pauses > 0)}"


def parse_beat(text: str) -> tuple[float, float, bool]:
    """``(beat time, last move, paused)`` of a heartbeat's text (an older watch's bare time too)."""
    parts = text.split("|")
    when = float(parts[0])
    return when, float(parts[1]) if len(parts) > 1 else when, len(parts) > 2 and parts[2] == "1"
