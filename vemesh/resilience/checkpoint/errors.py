"""The ways a checkpoint can fail to save or load, as exceptions.

Every rank raises the same one with the same text: vemesh decides on rank 0 and
broadcasts the verdict (or torch's checkpoint reader gathers every rank's failure),
so no rank is left waiting in a collective.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "DamagedCheckpointError",
    "IncompatibleCheckpointError",
    "CheckpointLockedError",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the text says which and why."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint at the given path."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint is incomplete or unreadable: a missing or truncated file, bad metadata.

    :func:`vemesh.checkpoint.load_latest` skips such a checkpoint (with a warning) and
    tries the previous one.
    """


class IncompatibleCheckpointError(CheckpointError):
    """A sound checkpoint that does not fit the model or optimizer: a different shape, missing
    or unexpected keys. :func:`vemesh.checkpoint.load_latest` stops on it instead of falling back,
    since an older checkpoint of the same run would not fit either."""


class CheckpointLockedError(CheckpointError):
    """Another job holds the checkpoint directory's lock; the text names it (host, pid, run id)."""
