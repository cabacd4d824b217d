"""The hang watch: torch's Flight Recorder on, a per-rank watchdog, and every rank's dump on a hang.

``VEMESH_HANG_DIR=DIR`` (or ``init_device_mesh(..., hang_dir=DIR)``) turns it on. torch's Flight
Recorder records every collective of every process group (``TORCH_FR_BUFFER_SIZE``, set here
when unset); this module adds only what the recorder lacks:

* a watchdog thread per rank that reads the recorder's per-group status (microseconds, no
  collective) and notices a collective that has waited ``VEMESH_HANG_AFTER`` seconds;
* the job's store (the rendezvous ``TCPStore``, never a collective) to tell every other rank;
* on every rank, the recorder's dump, the Python stack of each thread and the mesh's groups
  (pg name -> dim name and ranks) written to ``DIR/rank-N.json``; ranks stuck in compute write
  theirs too, since their watchdog threads still run;
* one rank (the one that noticed first) waits for the dumps, prints the diagnosis of
  :mod:`vemesh.hangs.diagnose` once, and every rank ends with exit code :data:`EXIT_CODE`.

A rank that gloo itself aborts (a collective whose sizes differ between ranks: gloo's
``Received data size doesn't match expected size``) cannot dump; ``faulthandler`` writes its
Python stacks to ``DIR/rank-N.fatal.txt``, which ``vemesh diagnose`` reads.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

ENV_DIR, ENV_AFTER = "VEMESH_HANG_DIR", "VEMESH_HANG_AFTER"
#: The recorder's ring of entries per process, when the user set no ``TORCH_FR_BUFFER_SIZE``.
BUFFER_SIZE = 20000
#: Without ``VEMESH_HANG_AFTER``, the watchdog fires at this fraction of the collective timeout.
AFTER_FRACTION = 0.5
#: The exit code of every rank of a job the watch ended.
EXIT_CODE = 3
_POLL_S = 0.5
_PREFIX = "vemesh_hang/"


#: (time_ns, step) of the latest steps this process marked (``VESCALE_DEVICE_MESH.mark_step``).
STEPS: list[tuple[int, int]] = []


def mark_step(step: int) -> None:
    STEPS.append((time.time_ns(), step))
    del STEPS[:-1024]


def prepare() -> None:
    """Turn torch's Flight Recorder on (before the first collective, when nothing set its size)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER_SIZE))


def recorder_json(entries: bool) -> dict[str, Any]:
    """torch's Flight Recorder dump of this process, as a dict (``entries``: with every entry)."""
    import torch

    return json.loads(torch._C._distributed_c10d._dump_fr_trace_json(entries, False))


def hang_after(timeout_s: float, env: dict[str, str] | None = None) -> float:
    """The watchdog's threshold: ``VEMESH_HANG_AFTER`` seconds, else half the collective timeout."""
    raw = (os.environ if env is None else env).get(ENV_AFTER, "")
    if not raw:
        return timeout_s * AFTER_FRACTION
    try:
        after = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_AFTER}={raw!r} is not a number of seconds") from None
    if not 0 < after < timeout_s:
        raise ValueError(
            f"{ENV_AFTER}={raw} must be above 0 and below the mesh's collective timeout ({timeout_s:g} s), "
            "or torch's timeout ends the job before the watch can name the hang; raise init_device_mesh's timeout="
        )
    return after


def stacks() -> list[dict[str, Any]]:
    """The Python stack of each thread of this process, innermost frame last (the watchdog's own left out)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():
        if names.get(ident) == "vemesh-hang-watch":
            continue
        frames = [[f.filename, f.lineno, f.name, f.line or ""] for f in traceback.extract_stack(frame)]
        out.append({"thread": names.get(ident, str(ident)), "main": ident == main, "frames": frames})
    return out


class HangWatch:
    """One rank's watchdog. ``describe()`` gives the mesh part of the dump (no collective in it)."""

    def __init__(self, directory: str | os.PathLike, after_s: float, describe: Callable[[], dict[str, Any]],
                 store: Any, rank: int, world_size: int) -> None:
        self.directory, self.after_s, self.describe = Path(directory), after_s, describe
        self.store, self.rank, self.world_size = store, rank, world_size
        # the store's keys of this watch: a torchrun restart after a hang, or a second init_device_mesh, starts
        # clean (every rank starts its watches in the same order: init_device_mesh is called by all)
        _STARTS.append(rank)
        self.keys = f"{_PREFIX}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{len(_STARTS)}/"
        # one id for this job's dumps, the same on every rank: a directory reused across runs keeps them apart
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
        sys.excepthook = self._on_exception
        threading.excepthook = lambda args: self._on_exception(args.exc_type, args.exc_value, args.exc_traceback, args)
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
        """A rank whose script raised (a peer died mid-collective, ...): every rank dumps, then the report."""
        hook = self._hooks[1] if thread_args is not None else self._hooks[0]
        if kind is KeyboardInterrupt or self._stop.is_set() or (thread_args is not None and thread_args.thread is self._thread):
            return hook(thread_args) if thread_args is not None else hook(kind, value, tb)
        self.exception = "".join(traceback.format_exception(kind, value, tb))
        print(self.exception, file=sys.stderr, flush=True)
        first = str(value).strip().splitlines()[0] if str(value).strip() else ""
        self._end(reporter=self._claim(f"rank {self.rank} raised {kind.__name__}: {first[:300]}"))

    def stop(self) -> None:
        self._stop.set()
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

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        while not self._stop.is_set():
            terminated = False
            if self._signals is not None:
                if select.select([self._signals], [], [], _POLL_S)[0]:
                    terminated = signal.SIGTERM in self._signals.recv(64)
            else:
                time.sleep(_POLL_S)
            try:
                if self.store.check([self.keys + "fired"]):
                    self._end(reporter=False)
                if terminated and self._own_term and signal.getsignal(signal.SIGTERM) is self._term_handler:
                    sys.stderr.flush()
                    os._exit(128 + signal.SIGTERM)
                late = self._late()
                if late is not None and self._claim(late):
                    self._end(reporter=True)
            except Exception as e:  # the store went away (the job is ending): nothing left to watch
                if self._stop.is_set():
                    return
                print(f"vemesh hang watch, rank {self.rank}: {type(e).__name__}: {e}", file=sys.stderr)
                return

    def _late(self) -> str | None:
        """A collective this rank has waited on for ``after_s``, said in the recorder's terms, or None."""
        now = time.monotonic()
        status = recorder_json(entries=False).get("pg_status", {})
        for pg, st in status.items():
            done, queued = int(st.get("last_completed_collective", -1)), int(st.get("last_enqueued_collective", -1))
            if queued <= done:
                self._pending.pop(pg, None)
                continue
            seq, since = self._pending.get(pg, (done + 1, now))
            if seq != done + 1:
                seq, since = done + 1, now
            self._pending[pg] = (seq, since)
            if now - since >= self.after_s:
                return f"rank {self.rank} waited {now - since:.0f} s on collective #{seq} of process group {pg}"
        return None

    def _claim(self, reason: str) -> bool:
        """Whether this rank is the first to report (the store's compare-and-set decides)."""
        mine = f"{self.rank}|{reason}"
        return self.store.compare_set(self.keys + "fired", "", mine).decode() == mine

    def _end(self, reporter: bool) -> None:
        """Dump, then (the reporter) wait for every dump and print the diagnosis; every rank exits."""
        if not self._ending.acquire(blocking=False):  # the other thread is ending the process already
            while True:
                time.sleep(60)
        self.dump()
        self.store.set(self.keys + f"dumped/{self.rank}", "1")
        if reporter:
            end = time.monotonic() + 15  # a rank gloo aborted never dumps: its fatal-error file says so
            while time.monotonic() < end and not all(
                self.store.check([self.keys + f"dumped/{r}"]) or self._died(r) for r in range(self.world_size)
            ):
                time.sleep(0.2)
            from vemesh.hangs.diagnose import diagnose, load

            try:
                text = diagnose(load(self.directory)).text()
            except Exception as e:  # the report must not hide the hang
                text = f"vemesh: could not diagnose {self.directory}: {type(e).__name__}: {e}"
            fired = self.store.get(self.keys + "fired").decode().partition("|")[2]
            what = fired if " raised " in fired else "a hang was found"
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

    def drop_empty_fatal(self) -> None:
        """Remove this rank's fatal-error file if faulthandler wrote nothing to it (the rank did not crash)."""
        path = Path(self._fatal.name)
        if path.exists() and path.stat().st_size == 0:
            path.unlink()

    def _died(self, rank: int) -> bool:
        path = self.directory / f"rank-{rank}.fatal.txt"
        return path.exists() and path.stat().st_size > 0

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
            "fired_by": int(by) if by else None, "reason": reason,
            "exception": getattr(self, "exception", ""), "mesh": self.describe(), "steps": STEPS, "stacks": stacks(), "flight_recorder": recorder_json(True),
        }
        path = self.directory / f"rank-{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
        return path


_WATCH: HangWatch | None = None
_STARTS: list[int] = []


def straggler_summary(describe: Callable[[], dict[str, Any]], since_ns: int = 0) -> str | None:
    """Every rank calls it (one ``all_gather_object`` over the world): per dim, who was last into the collectives
    entered since ``since_ns``, as one line on rank 0 (None elsewhere). The recorder must be on."""
    import torch.distributed as dist

    from vemesh.hangs.dumps import Job, rank_dump
    from vemesh.hangs.stragglers import stragglers

    fr = recorder_json(True)
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) <= 0:
        raise RuntimeError("straggler summaries read torch's Flight Recorder, which is off: set VEMESH_HANG_DIR or "
                           "TORCH_FR_BUFFER_SIZE in the environment before the first collective")
    fr["entries"] = [e for e in fr.get("entries", []) if int(e.get("time_created_ns", 0)) >= since_ns]
    mine = {"rank": dist.get_rank(), "host": socket.gethostname(), "flight_recorder": fr, "mesh": describe(),
            "steps": [s for s in STEPS if s[0] >= since_ns - 10**10]}
    docs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(docs, mine)
    if dist.get_rank() != 0:
        return None
    job = Job({d["rank"]: rank_dump(d) for d in docs}, None, len(docs))
    found = [d.line() for d in stragglers(job) if d.dim != "world"]
    return "stragglers: " + ("; ".join(found) if found else "no collective recorded by every member of its group")


def start(directory: str | os.PathLike, timeout_s: float, describe: Callable[[], dict[str, Any]]) -> HangWatch:
    """Start this process's watch (replacing an older one): the recorder must be on and the store reachable."""
    global _WATCH
    import torch.distributed as dist

    prepare()
    if int(os.environ["TORCH_FR_BUFFER_SIZE"]) <= 0:
        raise ValueError(f"{ENV_DIR} needs torch's Flight Recorder, but TORCH_FR_BUFFER_SIZE="
                         f"{os.environ['TORCH_FR_BUFFER_SIZE']}; unset it or make it positive")
    if _WATCH is not None:
        _WATCH.stop()
    store = dist.distributed_c10d._get_default_store()
    _WATCH = HangWatch(directory, hang_after(timeout_s), describe, store, dist.get_rank(), dist.get_world_size())
    if not _ATEXIT:
        atexit.register(lambda: _WATCH is not None and not _WATCH._stop.is_set() and dump())
        _ATEXIT.append(True)
    return _WATCH


_ATEXIT: list[bool] = []


def current() -> HangWatch | None:
    return _WATCH


def dump() -> Path | None:
    """Write this rank's dump now (a healthy run's, for ``vemesh diagnose --stragglers``); None when no watch runs.

    The watch does it at a normal interpreter exit too; call it in scripts that end with ``os._exit``.
    """
    if _WATCH is None:
        return None
    path = _WATCH.dump()
    _WATCH.drop_empty_fatal()
    return path
