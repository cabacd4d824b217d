"""The process's hang watch and step marks: :data:`HANGS`, which ``init_device_mesh(hang_dir=...)`` (or
``VEMESH_HANG_DIR``) starts and ``VESCALE_DEVICE_MESH.mark_step`` feeds; its watch is :class:`~vemesh.hangs.watch.HangWatch`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from vemesh.hangs.pace import Progress
from vemesh.hangs.record import ENV_DIR, hang_after, prepare
from vemesh.hangs.watch import HangWatch

__all__ = ["HANGS", "Hangs"]


class Hangs:
    """The process's hang watch and step marks (one instance, :data:`HANGS`; tests can build their own).

    ``mark_step(n)`` keeps the latest 1024 ``(time_ns, step)``; ``start`` replaces the running watch with a new
    one; ``dump`` writes this rank's dump of a healthy run (also at a normal interpreter exit); ``close`` stops
    the watch and takes back the exit hook.
    """

    def __init__(self) -> None:
        self.steps: collections.deque[tuple[int, int]] = collections.deque(maxlen=1024)
        #: this rank's progress and declared pauses, for the heartbeat (kept across watches)
        self.progress = Progress()
        self.watch: HangWatch | None = None
        self._started = 0  # watches started in this process: each has its own store keys
        self._at_exit = False

    def mark_step(self, step: int) -> None:
        self.steps.append((time.time_ns(), step))

    def start(self, directory: str | os.PathLike, timeout_s: float, describe: Callable[[], dict[str, Any]]) -> HangWatch:
        """Start this process's watch (closing an older one): the recorder must be on and the store reachable."""
        prepare()
        if int(os.environ["TORCH_FR_BUFFER_SIZE"]) <= 0:
            raise ValueError(f"{ENV_DIR} needs torch's Flight Recorder, but TORCH_FR_BUFFER_SIZE="
                             f"{os.environ['TORCH_FR_BUFFER_SIZE']}; unset it or make it positive")
        if self.watch is not None:
            self.watch.close()
        self._started += 1
        store = dist.distributed_c10d._get_default_store()
        self.watch = HangWatch(directory, hang_after(timeout_s), describe, store, dist.get_rank(), dist.get_world_size(),
                               self._started, self.steps, self.progress)
        if not self._at_exit:
            atexit.register(self._dump_at_exit)
            self._at_exit = True
        return self.watch

    def _dump_at_exit(self) -> None:
        """The program ended: its dump says so, and its peers' watch counts it as dumped, not as a dead rank."""
        if self.watch is not None and not self.watch.closed:
            self.watch.ended = True
            self.dump()
            with contextlib.suppress(Exception):  # the store may have gone with the job: no peer is left to ask
                self.watch.store.set(self.watch.keys + f"dumped/{self.watch.rank}", "1")

    def dump(self) -> Path | None:
        """Write this rank's dump now (:func:`vemesh.hangs.dump`); None when no watch runs."""
        if self.watch is None:
            return None
        path = self.watch.dump()
        self.watch.drop_empty_fatal()
        return path

    def close(self) -> None:
        """Stop the watch (its thread, hooks and files) and take back the exit hook."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self._at_exit:
            atexit.unregister(self._dump_at_exit)
            self._at_exit = False


#: The process's hang watch.
HANGS = Hangs()
