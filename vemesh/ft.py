"""``vemesh.ft``: the import path of :mod:`vemesh.resilience.replicas` (live fault tolerance with torchft)."""

from vemesh.resilience.replicas import (INSTALL_HINT, QuorumChange, ReplicaError, Replicas, import_torchft,
                                        start_replicas)

__all__ = ["INSTALL_HINT", "QuorumChange", "ReplicaError", "Replicas", "import_torchft", "start_replicas"]
