"""The job's pace, for the hang watch: when a wait is long for *this* job, and whether the ranks have stopped.

With ``VEMESH_HANG_AFTER`` unset, a collective is a *suspect* once it has waited :func:`threshold` seconds: the
conservative threshold (half the collective timeout) until the warm-up is over, then ``PACE_FACTOR`` times the
recent p99 step time (from ``mark_step``), never under ``FLOOR_S``. A suspect is a hang only when every other rank has
stopped as long: no step and no finished collective for that long, and none in a declared pause (its heartbeat says
so, :class:`Progress`). A rank that still moves, only slower, keeps the job's pace slow with it and is no hang.

A straggler is the other side of the same measure: each rank samples whether it waits in a collective
(:class:`Busy`), and its heartbeat carries its share of time spent outside them over the last window. In lockstep a
rank ``f`` times slower computes ``f`` times as long per step while its peers wait for it, so the ratio of its busy
share to the median rank's is its slowdown factor (:func:`straggler`); rank 0's watch names it, once per window.

Pure arithmetic on the marks, the samples and the heartbeats' text: no store, no torch.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

__all__ = ["FLOOR_S", "PACE_FACTOR", "SAMPLE_S", "STRAGGLER_FACTOR", "WARMUP_STEPS", "Busy", "Progress", "step_pace",
           "straggler", "straggler_line", "threshold"]

#: marked steps before the pace is trusted: the first intervals (compilation, the first loads) are left out, and
#: enough after them are needed to say what a step takes
WARMUP_STEPS = 10
_SKIPPED = 3
#: a wait longer than this many p99 steps is a suspect
PACE_FACTOR = 5.0
#: never a suspect before this many seconds (a step of a few ms would make the threshold a few ms)
FLOOR_S = 4.0
#: seconds between a rank's samples of whether it waits in a collective (jittered by the watch, so a step whose
#: length is a multiple of it is not always sampled at the same phase)
SAMPLE_S = 0.05
#: a rank busy this many times as long as the median of the others is a straggler
STRAGGLER_FACTOR = 1.25
#: fewer samples than this in the window say nothing about a rank's share
_MIN_SAMPLES = 20
#: a median busy share under this (every rank waits, nobody computes) gives no factor worth a word
_MIN_SHARE = 0.02


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


class Busy:
    """This rank's share of time outside collectives over the last ``window_s`` seconds, from samples."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, bool]] = collections.deque()

    def add(self, waiting: bool, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, waiting))
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()

    def share(self) -> float | None:
        """The fraction of the window's samples taken outside any collective; None with too few samples."""
        if len(self._samples) < _MIN_SAMPLES:
            return None
        return sum(not waiting for _, waiting in self._samples) / len(self._samples)


def straggler(shares: Mapping[int, float]) -> tuple[int, float, float] | None:
    """``(rank, factor, median share of the others)`` of the rank busy longest, when it is busy at least
    :data:`STRAGGLER_FACTOR` times as long as the median of the others; None otherwise (or with under two ranks)."""
    if len(shares) < 2:
        return None
    rank = max(sorted(shares), key=lambda r: shares[r])
    median = statistics.median(v for r, v in shares.items() if r != rank)
    if median < _MIN_SHARE:
        return None
    factor = shares[rank] / median
    return (rank, factor, median) if factor >= STRAGGLER_FACTOR else None


def straggler_line(rank: int, where: str, groups: str, factor: float, share: float, median: float,
                   window: float) -> str:
    """The line rank 0's watch prints for a straggler (``where``: its coordinates; ``groups``: "; its groups: ...")."""
    return (f"vemesh: straggler: rank {rank}{f' ({where})' if where else ''} is {factor:.1f}x slower than the median "
            f"rank over the last {window:g} s: outside collectives {share:.0%} of the time, the median rank "
            f"{median:.0%}{groups}; not a hang, the job goes on")


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

    def beat(self, busy: float | None = None) -> str:
        """The heartbeat's text: ``now|last move|paused|busy share`` (``-`` while the share is unknown)."""
        share = "-" if busy is None else f"{busy:.4f}"
        return f"{time.time()!r}|{self.moved!r}|{int(self._pauses > 0)}|{share}"


def parse_beat(text: str) -> tuple[float, float, bool, float | None]:
    """``(beat time, last move, paused, busy share or None)`` of a heartbeat's text (an older watch's too)."""
    parts = text.split("|")
    when = float(parts[0])
    busy = float(parts[3]) if len(parts) > 3 and parts[3] != "-" else None
    return when, float(parts[1]) if len(parts) > 1 else when, len(parts) > 2 and parts[2] == "1", busy
