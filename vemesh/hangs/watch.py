"""The hang watch: a per-rank watchdog on torch's Flight Recorder, and every rank's dump on a hang.

:class:`HangWatch` is one rank's watchdog (its thread, files, store keys and hooks, each undone by ``close()``);
:mod:`vemesh.hangs.process` owns the process's watch and step marks.
The watch holds a reference to what describes the mesh; the mesh holds nothing of the watch. What the watch
reads of the process is :mod:`vemesh.hangs.record`; ranks reach each other through the job's store only.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


from vemesh.hangs.diagnose import diagnose, load
from vemesh.hangs.dumps import dead_line, rank_place
from vemesh.hangs.pace import (SAMPLE_S, Busy, Progress, parse_beat, step_pace, straggler, straggler_line,
                               threshold)
from vemesh.hangs.record import ENV_AFTER, EXIT_CODE, fatal_file, recorder_json, stacks, straggler_window

__all__ = ["HangWatch"]

_POLL_S = 0.5
_BEAT_S = 1.0  #: seconds between a rank's heartbeats in the job's store (1,024 ranks make 1,024 writes a second)
_DEAD_WINDOW_S = 6.0  #: how long, after the launcher's SIGTERM, a rank is given to answer before it is called dead
_PREFIX = "vemesh_hang/"


class HangWatch:
    """One rank's watchdog: it owns its thread, its files (the fatal-error file, the dump), its store keys and the
    hooks it installs (``sys.excepthook``, ``threading.excepthook``, SIGTERM's wakeup fd); :meth:`close` undoes each.
    ``describe()`` gives the mesh part of the dump (no collective in it)."""

    def __init__(self, directory: str | os.PathLike, after_s: float, describe: Callable[[], dict[str, Any]],
                 store: Any, rank: int, world_size: int, number: int, steps: Sequence[tuple[int, int]],
                 progress: Progress | None = None) -> None:
        self.directory, self.after_s, self.describe = Path(directory), after_s, describe
        #: with VEMESH_HANG_AFTER unset, the threshold follows the job's pace after the warm-up (vemesh.hangs.pace)
        self.paced = not os.environ.get(ENV_AFTER)
        self.progress = Progress() if progress is None else progress
        self.window = straggler_window()
        self.busy = Busy(self.window or 60.0)  # this rank's share of time outside collectives, for its heartbeat
        self._finished, self.store, self.rank, self.world_size, self.steps = 0, store, rank, world_size, steps
        # this watch's keys: a second init_device_mesh starts clean (all ranks number their watches alike; a restart's
        # store is its own, mesh.startup._job_store); one id for the job's dumps keeps a reused directory's apart
        self.keys = f"{_PREFIX}{number}/"
        self.run_id = store.compare_set(self.keys + "run", "", uuid.uuid4().hex).decode()
        self._pending: dict[str, tuple[int, float]] = {}  # pg id -> (first pending seq, when first seen)
        self._stop, self._ending = threading.Event(), threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        for old in (self.directory / f"rank-{rank}.json", self.directory / f"rank-{rank}.fatal.txt"):
            old.unlink(missing_ok=True)  # an earlier run's, in a reused directory
        self._fatal = open(self.directory / f"rank-{rank}.fatal.txt", "w")
        faulthandler.enable(self._fatal, all_threads=True)
        self._signals = self._catch_sigterm()
        self._hooks = (sys.excepthook, threading.excepthook)
        #: the thread that trains (the one that started the watch): only its uncaught exception ends the job
        self.training_thread = threading.current_thread()
        sys.excepthook = self._on_exception
        threading.excepthook = lambda args: self._on_exception(args.exc_type, args.exc_value, args.exc_traceback, args)
        self.store.set(self.keys + f"beat/{rank}", self.progress.beat())  # the first beat before the first collective
        self._mesh()  # as the mesh is now: what a dump at the program's end says if its groups are gone by then
        self._thread = threading.Thread(target=self._run, name="vemesh-hang-watch", daemon=True)
        self._thread.start()

    def _catch_sigterm(self) -> socket.socket | None:
        """Let this thread see SIGTERM even while the main thread blocks in a collective (torchrun sends it to
        every rank when one dies): a wakeup fd, and a Python handler if there was none (exit as the default would)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        self._own_term = signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        if signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False) != -1:  # someone else's (asyncio): theirs
            signal.set_wakeup_fd(-1)
            return None
        if self._own_term:
            self._term_handler = lambda *_: None  # this thread exits the process for it, while the handler is ours
            signal.signal(signal.SIGTERM, self._term_handler)
        self._wakeup = writer
        return reader

    def _on_exception(self, kind: type, value: BaseException, tb: Any, thread_args: Any = None) -> None:
        """The training thread raised (a peer died mid-collective, ...): every rank dumps, then the report. Any other
        thread's exception (a prefetch thread, a metrics uploader) goes to the earlier hook: it dies, training goes on."""
        hook = self._hooks[1] if thread_args is not None else self._hooks[0]
        elsewhere = thread_args is not None and thread_args.thread is not self.training_thread
        if kind is KeyboardInterrupt or self._stop.is_set() or elsewhere:
            return hook(thread_args) if thread_args is not None else hook(kind, value, tb)
        if self._ending.locked():  # ending the job already: a peer that left broke this rank's collective (gloo's
            return self._end()  # "Connection closed by peer"): no news, no traceback; wait for the exit
        self.exception = "".join(traceback.format_exception(kind, value, tb))
        print(self.exception, file=sys.stderr, flush=True)
        first = str(value).strip().splitlines()[0] if str(value).strip() else ""
        self._end(claim=f"rank {self.rank} raised {kind.__name__}: {first[:300]}")

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        """Stop the thread and give back every hook, signal and file this watch took (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * _POLL_S)
        sys.excepthook, threading.excepthook = self._hooks
        if self._signals is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
            if self._own_term and signal.getsignal(signal.SIGTERM) is self._term_handler:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._signals.close()
            self._wakeup.close()
        faulthandler.disable()
        self._fatal.close()
        self.drop_empty_fatal()

    def _run(self) -> None:
        beat = duties = 0.0
        named = time.monotonic()  # the last straggler check (rank 0's): one per window
        while not self._stop.is_set():
            terminated, wait = False, random.uniform(0.5, 1.5) * SAMPLE_S  # jittered: no phase-locked sampling
            if self._signals is not None:
                if select.select([self._signals], [], [], wait)[0]:
                    terminated = signal.SIGTERM in self._signals.recv(64)
            else:
                time.sleep(wait)
            try:
                status = recorder_json(entries=False).get("pg_status", {})
                self.busy.add(any(int(st.get("last_enqueued_collective", -1)) > int(st.get("last_completed_collective", -1))
                                  for st in status.values()))
                if not terminated and time.monotonic() - duties < _POLL_S:
                    continue
                duties = time.monotonic()
                if duties - beat >= _BEAT_S:  # the heartbeat: a rank whose beat stops is dead
                    self.progress.update(self.steps[-1][1] if self.steps else -1, self._finished)
                    self.store.set(self.keys + f"beat/{self.rank}", self.progress.beat(self.busy.share()))
                    beat = duties
                if self.store.check([self.keys + "fired"]):
                    self._end()
                if terminated and self._own_term and signal.getsignal(signal.SIGTERM) is self._term_handler:
                    self._on_sigterm()
                late = self._late(status)
                if late is not None:
                    self._end(claim=late)
                if self.rank == 0 and self.window and duties - named >= self.window:
                    named = duties
                    self._name_straggler()
            except Exception as e:  # the store went away (the job is ending): nothing left to watch
                if self._stop.is_set():
                    return
                print(f"vemesh hang watch, rank {self.rank}: {type(e).__name__}: {e}", file=sys.stderr)
                return

    def _name_straggler(self) -> None:
        """Rank 0, once per window: a straggler by the heartbeats' busy shares (:func:`vemesh.hangs.pace.straggler`),
        named with its factor on stderr; not while a rank is in a declared pause or a share is unknown. No ending."""
        keys = [self.keys + f"beat/{r}" for r in range(self.world_size)]
        if self.world_size < 2 or not self.store.check(keys):
            return
        beats = [parse_beat(v.decode()) for v in self.store.multi_get(keys)]
        if any(paused or busy is None for _, _, paused, busy in beats):
            return
        found = straggler({r: b[3] for r, b in enumerate(beats)})
        if found is not None:
            rank, factor, median = found
            print(straggler_line(rank, *rank_place(self.describe() or {}, rank), factor, beats[rank][3], median,
                                 self.window), file=sys.stderr, flush=True)

    def _on_sigterm(self) -> None:
        """The launcher ends the job (torchrun sends SIGTERM to every rank when one exits). A rank already ending
        (the training thread raised, a peer reported) finishes its report first; otherwise one rank looks for the
        dead: ranks that neither got the SIGTERM nor dumped, and whose heartbeat stopped. A dead rank is reported,
        with what its peers were doing; a job ended with every rank alive (an elastic restart, a user's kill) just
        exits, as without the watch."""
        if self._ending.locked():  # _end runs on the training thread and exits the process after the report
            return
        self.store.set(self.keys + f"term/{self.rank}", "1")
        if self.store.compare_set(self.keys + "scan", "", str(self.rank)).decode() == str(self.rank):
            dead, crashed = self._dead_ranks()
            if dead or crashed:  # a crashed rank's fatal-error file names it in the report: no DEAD line of its own
                first = min(dead + crashed)
                self._end(claim=f"rank {first} {'crashed' if first in crashed else 'died'}: the launcher ended the job",
                          dead=dead)
            self.store.set(self.keys + "clean", "1")
            if self.store.check([self.keys + "fired"]):  # another rank reports (one raised meanwhile): dump for it
                self._end()
        else:
            end = time.monotonic() + _DEAD_WINDOW_S + 5
            while time.monotonic() < end and not self.store.check([self.keys + "clean"]):
                if self.store.check([self.keys + "fired"]):
                    self._end()
                time.sleep(0.2)
        if self._ending.locked():  # the training thread raised meanwhile: its _end reports and exits
            return
        sys.stderr.flush()
        self.drop_empty_fatal()  # a job the launcher ended with every rank alive leaves no empty fatal-error file
        os._exit(128 + signal.SIGTERM)

    def _dead_ranks(self) -> tuple[list[int], list[int]]:
        """(dead, crashed): the ranks that neither got the launcher's SIGTERM nor dumped, and whose heartbeat is
        stale, after up to :data:`_DEAD_WINDOW_S` (a loaded machine delays a live rank's answer, so a silent rank gets
        the whole window); and those that wrote a fatal-error file (a crash: a segfault, an abort), which need no
        window. Both empty as soon as every rank has answered."""
        end = time.monotonic() + _DEAD_WINDOW_S
        while True:
            waiting, silent, crashed = False, [], []
            for r in range(self.world_size):
                if any(self.store.check([self.keys + f"{k}/{r}"]) for k in ("term", "dumped", "ending")):
                    continue  # it answered: alive
                if fatal_file(self.directory / f"rank-{r}.fatal.txt"):
                    crashed.append(r)  # it crashed while its peers were elsewhere than in a collective with it
                elif self._silent(r):
                    silent.append(r)
                else:
                    waiting = True  # beating, not answered yet
            if (not silent and not waiting) or time.monotonic() >= end:
                return silent, crashed
            time.sleep(0.2)

    def _late(self, status: dict[str, Any]) -> str | None:
        """A collective this rank has waited on for the threshold, said in the recorder's terms, or None. After the
        warm-up (with VEMESH_HANG_AFTER unset) the threshold is the job's pace, and a wait is a hang only when every
        other rank has stopped that long too (:mod:`vemesh.hangs.pace`)."""
        now = time.monotonic()
        limit, paced = threshold(self.steps, self.after_s) if self.paced else (self.after_s, False)
        finished = 0
        for pg, st in status.items():
            done, queued = int(st.get("last_completed_collective", -1)), int(st.get("last_enqueued_collective", -1))
            finished += done + 1
            if queued <= done:
                self._pending.pop(pg, None)
                continue
            kept = self._pending.get(pg)  # when this collective was first seen pending
            seq, since = kept if kept is not None and kept[0] == done + 1 else (done + 1, now)
            self._pending[pg] = (seq, since)
            if now - since >= limit and (not paced or self._all_stopped(limit)):
                pace = f" (this job's steps take {step_pace(self.steps):.3g} s at p99)" if paced else ""
                return f"rank {self.rank} waited {now - since:.0f} s on collective #{seq} of process group {pg}{pace}"
        self._finished = finished
        return None

    def _all_stopped(self, limit: float) -> bool:
        """Every other rank's heartbeat says it has not moved for ``limit`` seconds and is in no declared pause."""
        now = time.time()
        for r in range(self.world_size):
            key = self.keys + f"beat/{r}"
            if r == self.rank or not self.store.check([key]):
                continue
            _, moved, paused, _ = parse_beat(self.store.get(key).decode())
            if paused or now - moved < limit:
                return False
        return True

    def _claim(self, reason: str) -> bool:
        """Whether this rank is the first to report (the store's compare-and-set decides)."""
        mine = f"{self.rank}|{reason}"
        return self.store.compare_set(self.keys + "fired", "", mine).decode() == mine

    def _end(self, claim: str | None = None, dead: Sequence[int] = ()) -> None:
        """Dump, then (the reporter) wait for every dump and print the diagnosis; every rank exits. ``claim``: why
        this rank would report; it does if no rank claimed first. ``dead``: the ranks found dead (no heartbeat, no
        dump): named first, with their groups. The claim is made holding the ending lock: made before it, this rank's
        other thread could see the claim in the store, take it for a peer's and end as a bystander, waiting for a
        report that the claimant, locked out, never made (ci, a rank aborted by gloo: no report, every rank killed)."""
        if not self._ending.acquire(blocking=False):  # the other thread is ending the process already
            while True:
                time.sleep(60)
        reporter = claim is not None and self._claim(claim)
        self.store.set(self.keys + f"ending/{self.rank}", "1")  # alive: its heartbeat may stop while it dumps
        self.dump()
        self.store.set(self.keys + f"dumped/{self.rank}", "1")
        if reporter:
            end = time.monotonic() + 15  # while a rank beats without a dump (gloo's aborted ranks leave a fatal file)
            while time.monotonic() < end and any(r not in dead and self._silent(r, 4 * _BEAT_S) is False
                                                 for r in range(self.world_size)):
                time.sleep(0.2)
            try:
                text = diagnose(load(self.directory)).text()
            except Exception as e:  # the report must not hide the hang
                text = f"vemesh: could not diagnose {self.directory}: {type(e).__name__}: {e}"
            late = time.monotonic() >= end  # a rank still "ending" without a dump by now died while dumping
            dead = sorted(set(dead) | {r for r in range(self.world_size) if self._silent(r, ending_alive=not late)})
            text = "".join(dead_line(r, *rank_place(self.describe() or {}, r)) for r in dead) + text
            fired = self.store.get(self.keys + "fired").decode().partition("|")[2]
            what = fired if any(w in fired for w in (" raised ", " died", " crashed")) else "a hang was found"
            if dead and " died" not in fired:  # a peer's connection error is what the rank's death looked like
                what = f"rank {', '.join(map(str, dead))} died ({what})"
            print(f"\nvemesh: {what}; every rank wrote its dump to {self.directory}\n{text}\n"
                  f"(again: vemesh diagnose {self.directory})", file=sys.stderr, flush=True)
            self.store.set(self.keys + "reported", "1")
        else:
            end = time.monotonic() + 30
            while time.monotonic() < end and not self.store.check([self.keys + "reported"]):
                time.sleep(0.2)
        sys.stdout.flush()
        sys.stderr.flush()
        self._fatal.close()
        self.drop_empty_fatal()
        os._exit(EXIT_CODE)

    def _silent(self, rank: int, stale_s: float = 2 * _BEAT_S, ending_alive: bool = True) -> bool | None:
        """No dump, no fatal-error file, and a heartbeat older than ``stale_s`` (two beats): a rank that is gone.
        None (falsy) for a rank that dumped or wrote its fatal-error file: accounted for. A rank that said it is
        ending (dumping), or that answered the launcher's SIGTERM (its heartbeat stops while it waits for the scan),
        is alive while ``ending_alive``."""
        if self.store.check([self.keys + f"dumped/{rank}"]) or fatal_file(self.directory / f"rank-{rank}.fatal.txt"):
            return None
        if ending_alive and any(self.store.check([self.keys + f"{k}/{rank}"]) for k in ("ending", "term")):
            return False
        key = self.keys + f"beat/{rank}"
        beat = parse_beat(self.store.get(key).decode())[0] if self.store.check([key]) else 0.0
        return time.time() - beat > stale_s

    def drop_empty_fatal(self) -> None:
        """Remove this rank's fatal-error file if faulthandler wrote nothing to it (the rank did not crash)."""
        fatal_file(Path(self._fatal.name), drop_empty=True)

    def _mesh(self) -> dict[str, Any]:
        """The mesh's description, or as last described where its groups are gone (a program that ends with
        ``destroy_process_group()``, as torch asks, then dumps at its exit)."""
        try:
            self._described = self.describe()
        except Exception:  # noqa: BLE001 -- torch cannot resolve a destroyed group's name
            pass
        return getattr(self, "_described", None) or {}

    def dump(self) -> Path:
        """Write this rank's dump (recorder, stacks, mesh, steps) and return its path."""
        try:
            fired = self.store.get(self.keys + "fired").decode() if self.store.check([self.keys + "fired"]) else ""
        except Exception:  # at exit the store may be gone: a healthy run's dump
            fired = ""
        by, _, reason = fired.partition("|")
        doc = {
            "vemesh_hang_dump": 1, "run": self.run_id, "rank": self.rank, "world_size": self.world_size, "host": socket.gethostname(),
            "pid": os.getpid(), "time_ns": time.time_ns(), "after_s": self.after_s,
            "fired_by": int(by) if by else None, "reason": reason, "ended": getattr(self, "ended", False),  # at exit
            "exception": getattr(self, "exception", ""), "mesh": self._mesh(), "steps": list(self.steps), "stacks": stacks(), "flight_recorder": recorder_json(True),
        }
        path, tmp = self.directory / f"rank-{self.rank}.json", self.directory / f"rank-{self.rank}.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
        return path
