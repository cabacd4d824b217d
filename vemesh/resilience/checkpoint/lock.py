"""One job per checkpoint directory: a lock file that names its holder.

``ckpt/.vemesh.lock`` holds the host, process id, start time and torchrun run id of the job that
took it (taken by global rank 0, at start, before any training):

* a second job fails at once with that holder in the message;
* a restarted attempt of the same torchrun job (same ``TORCHELASTIC_RUN_ID``) takes it over, so
  ``--max-restarts`` recovery keeps working;
* so does a new job when the holder was a process on this host that no longer exists.

A holder on another host that left no run id cannot be checked from here: the message then says
which file to remove once that job is gone. Creating the lock also proves, before step 1, that the
directory is writable. Pure file I/O; :mod:`vemesh.resilience.checkpoint.api` runs it on rank 0.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path
from typing import Any

from vemesh.resilience.checkpoint.errors import CheckpointError, CheckpointLockedError

__all__ = ["LOCK", "holder", "take", "release", "describe"]

LOCK = ".vemesh.lock"


def holder() -> dict[str, Any]:
    """Who this process is, as a lock records it."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "run_id": None if run_id in (None, "", "none") else run_id,
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }


def describe(h: dict[str, Any]) -> str:
    return (f"host {h.get('host')!r}, pid {h.get('pid')}, started {h.get('started')}, "
            f"torchrun run id {h.get('run_id') or 'none'} (attempt {h.get('attempt')})")


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _may_take_over(old: dict[str, Any], me: dict[str, Any]) -> bool:
    if old.get("run_id") and old.get("run_id") == me["run_id"]:
        return True  # a restarted attempt of the same torchrun job
    if old.get("host") == me["host"] and (old.get("pid") == me["pid"] or not _alive(old.get("pid"))):
        return True  # this process, or a dead one on this host
    return False


def take(root: Path) -> dict[str, Any]:
    """Take ``root``'s lock for this process (creating ``root``); return the holder written.

    Raises:
        CheckpointLockedError: another live job holds it.
        CheckpointError: ``root`` cannot be created or written.
    """
    me = holder()
    try:
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                old = json.loads(path.read_text())
            except (OSError, ValueError):
                old = {}
            if not isinstance(old, dict) or not _may_take_over(old, me):
                raise CheckpointLockedError(
                    f"checkpoint directory '{root}' is in use by another job ({describe(old if isinstance(old, dict) else {})}). "
                    f"Use another --checkpoint-dir, or remove '{path}' if that job is gone"
                ) from None
            tmp = root / f"{LOCK}.{me['pid']}"
            tmp.write_text(json.dumps(me))
            os.replace(tmp, path)
            return me
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return me
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"checkpoint directory '{root}' is not writable: {e.strerror or e}") from None


def release(root: Path) -> None:
    """Remove ``root``'s lock if this process holds it."""
    path = root / LOCK
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    me = holder()
    if isinstance(old, dict) and old.get("host") == me["host"] and old.get("pid") == me["pid"]:
        path.unlink(missing_ok=True)


def conflict(root: Path) -> str | None:
    """A description of another live job's lock on ``root``, or None."""
    try:
        old = json.loads((root / LOCK).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(old, dict) and not _may_take_over(old, holder()):
        return describe(old)
    return None
