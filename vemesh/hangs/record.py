"""What the hang watch reads of this process, with no thread and no communication: torch's Flight Recorder
(turned on here), the watchdog's threshold, and each thread's Python stack.

``VEMESH_HANG_DIR=DIR`` (or ``init_device_mesh(..., hang_dir=DIR)``) turns the watch on
(:mod:`vemesh.hangs.watch`). torch's Flight Recorder records every collective of every process group
(``TORCH_FR_BUFFER_SIZE``, set here when unset); the watch adds only what the recorder lacks:

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

import json
import os
import sys
import threading
import traceback
from typing import Any

ENV_DIR, ENV_AFTER, ENV_WINDOW = "VEMESH_HANG_DIR", "VEMESH_HANG_AFTER", "VEMESH_STRAGGLER_WINDOW"
#: Seconds over which a rank's busy share is measured, and between two straggler lines (``VEMESH_STRAGGLER_WINDOW``).
WINDOW_S = 60.0
#: The recorder's ring of entries per process, when the user set no ``TORCH_FR_BUFFER_SIZE``.
BUFFER_SIZE = 20000
#: Without ``VEMESH_HANG_AFTER``, the watchdog fires at this fraction of the collective timeout.
AFTER_FRACTION = 0.5
#: The exit code of every rank of a job the watch ended.
EXIT_CODE = 3


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


def straggler_window(env: dict[str, str] | None = None) -> float:
    """``VEMESH_STRAGGLER_WINDOW`` seconds (default :data:`WINDOW_S`); 0 turns the straggler lines off."""
    raw = (os.environ if env is None else env).get(ENV_WINDOW, "")
    try:
        window = float(raw) if raw else WINDOW_S
    except ValueError:
        raise ValueError(f"{ENV_WINDOW}={raw!r} is not a number of seconds (0 turns straggler lines off)") from None
    if window < 0:
        raise ValueError(f"{ENV_WINDOW}={raw} must be 0 (off) or a positive number of seconds")
    return window


def fatal_file(path: "os.PathLike[str] | str", drop_empty: bool = False) -> bool:
    """Whether a rank's fatal-error file holds something (faulthandler wrote: the rank crashed); ``drop_empty``
    removes it when it is empty."""
    import pathlib

    path = pathlib.Path(path)
    size = path.stat().st_size if path.exists() else -1
    if drop_empty and size == 0:
        path.unlink()
    return size > 0


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
