"""``vemesh.checkpoint``: the import path of :mod:`vemesh.resilience.checkpoint` (checkpoints on any mesh)."""

from vemesh.resilience.checkpoint import *  # noqa: F403
from vemesh.resilience.checkpoint import __all__  # noqa: F401
