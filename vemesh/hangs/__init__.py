"""Hangs and stragglers named in mesh terms, on torch's Flight Recorder.

* :mod:`vemesh.hangs.record`: ``VEMESH_HANG_DIR`` (or ``init_device_mesh(hang_dir=)``): the
  recorder on, a watchdog per rank, every rank's dump on a hang, the diagnosis printed once.
* :mod:`vemesh.hangs.diagnose`: reads the dumps (vemesh's, or torch's own with a mesh shape
  and dim names) and says which dim, which group, which rank never came; stragglers per dim.
"""

from vemesh.hangs.record import ENV_AFTER, ENV_DIR, EXIT_CODE, dump

__all__ = ["ENV_AFTER", "ENV_DIR", "EXIT_CODE", "dump", "straggler_summary"]


def straggler_summary(mesh=None, since_ns: int = 0) -> "str | None":
    """Per mesh dim, which rank was last into the collectives since ``since_ns``: one line on rank 0, None on the
    others. Every rank must call it (it gathers over the world). ``mesh`` defaults to ``VESCALE_DEVICE_MESH``;
    torch's Flight Recorder must be on (``VEMESH_HANG_DIR``, or ``TORCH_FR_BUFFER_SIZE``, before the first collective).
    """
    from vemesh.hangs.record import straggler_summary as _summary

    if mesh is None:
        from vemesh import VESCALE_DEVICE_MESH as mesh
    return _summary(mesh.hang_description, since_ns)
