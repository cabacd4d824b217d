"""The mesh's display and its hang watch: ``describe``, the start-up layout log, ``mark_step``.

Kept apart from :mod:`vemesh.mesh.manager` so the manager reads as queries; the watch itself
(torch's Flight Recorder, the watchdog, the dumps) is :mod:`vemesh.hangs.record`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from vemesh.hangs import record
from vemesh.hangs.watch import HANGS
from vemesh.layout.describe import check_layout, describe_layout

_logger = logging.getLogger("vemesh")


class MeshDebug:
    """``describe``, ``mark_step`` and the hang watch of :class:`~vemesh.VeDeviceMesh`."""

    def describe(self, rank: int | None = None, devices_per_host: int | None = None) -> str:
        """The layout as text: the rank grid, the groups along every name, and ``rank``'s view.

        ``rank`` defaults to this rank. ``devices_per_host`` defaults to torchrun's
        ``LOCAL_WORLD_SIZE`` when set.
        """

        if devices_per_host is None and "LOCAL_WORLD_SIZE" in os.environ:
            devices_per_host = int(os.environ["LOCAL_WORLD_SIZE"])
        return describe_layout(self.layout, rank=self._my_rank() if rank is None else rank, devices_per_host=devices_per_host)

    def mark_step(self, step: int) -> None:
        """Tell the hang watch which training step this rank is on (call it at the top of each step).

        ``vemesh diagnose`` then says the step of each collective ("DP all-reduce #42 at step 57").
        Straggler reports then give the time a rank held each group up per step. Costs a list append.
        """
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"mark_step takes the step as an int; got {step!r}")
        HANGS.mark_step(step)

    def _log_layout(self) -> None:

        per_host = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
        _logger.info("%s", self.describe(devices_per_host=per_host))
        for warning in check_layout(self.layout, per_host):
            _logger.warning("%s", warning)

    @staticmethod
    def _hang_dir(hang_dir: Any) -> str | None:
        """The directory of the hang watch (``hang_dir=``, else ``VEMESH_HANG_DIR``), with the recorder turned on."""
        found = os.fspath(hang_dir) if hang_dir is not None else os.environ.get(record.ENV_DIR) or None
        if found is not None:
            record.prepare()
        return found

    def _watch_hangs(self, directory: str | None) -> None:
        if directory is None or dist.get_backend() == "fake":
            return
        timeout = self._timeout.total_seconds() if self._timeout is not None else dist.default_pg_timeout.total_seconds()
        HANGS.start(directory, timeout, self.hang_description)
        if not record.recorder_json(entries=False).get("pg_status"):
            raise RuntimeError(
                f"{record.ENV_DIR}={directory}: torch's Flight Recorder recorded none of the start-up's collectives, "
                "so it was off when they ran; set VEMESH_HANG_DIR (or TORCH_FR_BUFFER_SIZE) in the environment "
                "before the process starts, or pass hang_dir= before any other collective"
            )
