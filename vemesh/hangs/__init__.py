"""Hangs and stragglers named in mesh terms, on torch's Flight Recorder.

* :mod:`vemesh.hangs.watch`: ``VEMESH_HANG_DIR`` (or ``init_device_mesh(hang_dir=)``): the recorder on, a
  watchdog per rank, every rank's dump on a hang, the diagnosis printed once (:data:`~vemesh.hangs.process.HANGS`);
* :mod:`vemesh.hangs.record`: what the watch reads of this process (the recorder, the stacks);
* :mod:`vemesh.hangs.diagnose`: reads the dumps (vemesh's, or torch's own with a mesh shape
  and dim names) and says which dim, which group, which rank never came; stragglers per dim;
* :mod:`vemesh.hangs.gather`: the one module here that communicates (the straggler summary).
"""

from pathlib import Path
from typing import Any

from vemesh.hangs.record import ENV_AFTER, ENV_DIR, EXIT_CODE

__all__ = ["ENV_AFTER", "ENV_DIR", "EXIT_CODE", "dump", "paused", "straggler_summary"]


def paused() -> Any:
    """A context manager: a stretch in which this rank may not move for long (an evaluation on one rank, a long save
    of your own). While it lasts, no rank's watch calls a wait on it a hang by the job's pace; the conservative
    threshold (half the collective timeout, or ``VEMESH_HANG_AFTER``) still holds. vemesh's checkpoints declare
    theirs. ``with vemesh.hangs.paused(): evaluate(model)``."""
    from vemesh.hangs.process import HANGS  # torch.distributed on first use: `vemesh diagnose` starts fast

    return HANGS.progress.paused()


def dump() -> "Path | None":
    """Write this rank's dump now (a healthy run's, for ``vemesh diagnose --stragglers``); None when no watch runs.

    The watch does it at a normal interpreter exit too; call it in scripts that end with ``os._exit``.
    """
    from vemesh.hangs.process import HANGS  # torch.distributed is imported on first use: `vemesh diagnose` starts fast

    return HANGS.dump()


def straggler_summary(mesh: Any = None, since_ns: int = 0) -> "str | None":
    """Per mesh dim, which rank was last into the collectives since ``since_ns``: one line on rank 0, None on the
    others. Every rank must call it (it gathers over the world). ``mesh`` defaults to ``VESCALE_DEVICE_MESH``;
    torch's Flight Recorder must be on (``VEMESH_HANG_DIR``, or ``TORCH_FR_BUFFER_SIZE``, before the first collective).
    """
    from vemesh.hangs.gather import straggler_summary as gathered  # communicates: torch.distributed on first use
    from vemesh.hangs.process import HANGS  # torch.distributed on first use: `vemesh diagnose` starts fast

    if mesh is None:
        from vemesh import VESCALE_DEVICE_MESH as mesh  # the live mesh imports torch: on first use only
    return gathered(mesh.hang_description, HANGS.steps, since_ns)
