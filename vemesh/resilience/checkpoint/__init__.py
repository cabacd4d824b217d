"""Checkpoints that survive failures and load on a mesh of another shape.

Built on ``torch.distributed.checkpoint`` (DCP)::

    from vemesh import checkpoint

    resumed = checkpoint.load_latest("ckpt", model=model, optimizer=optimizer)   # None on a fresh run
    start = resumed[0] if resumed else 0
    for step in range(start + 1, steps + 1):
        ...
        if step % 50 == 0:
            checkpoint.save("ckpt", model=model, optimizer=optimizer, step=step, extra={"tokens": n})

What is stored: every parameter as a DTensor with its TP placements (or a plain tensor), and
the optimizer state per parameter, shaped and sharded like the parameter, also for the ZeRO-1
:class:`~vemesh.optim.DistributedOptimizer` (whose state lives in flat per-DP-rank shards). So a
checkpoint written on ``(DP, TP) = (2, 2)`` loads on ``(4, 1)``, ``(1, 4)`` or one process:
on ``(4, 1)`` rank 3 reads whole tensors and keeps, of the Adam state, the quarter of each
gradient bucket it owns; on ``(1, 4)`` rank 3 reads the last TP quarter of every sharded weight
and of its Adam state. Hyperparameters go to ``vemesh.json``, as JSON, with ``extra``.

Elastic training: run the same script under ``torchrun --nnodes=MIN:MAX --rdzv-backend=c10d
--max-restarts=K`` with a ``-1`` on DP; when the world shrinks or grows, torchrun restarts the
workers, ``init_device_mesh`` gets the new world, and ``load_latest`` reshards the last good
checkpoint onto it. Set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun so that a joining
node can rendezvous (a torch 2.13 bug; see the README's elastic section for the commands).
torchrun stops running workers with SIGTERM (SIGKILL 30 s later) before a grow. A training
loop that saves at its next step boundary on SIGTERM, agreed over the ranks, redoes nothing;
the GPT example's ``stopping.py`` shows how.

Safety: one job per directory (:func:`acquire_lock`); every file is checksummed at save and
verified at load, so a flipped bit, a swapped-in stale shard, a symlink or an edited manifest
makes the checkpoint *damaged* and the previous good one is used; nothing non-finite is ever
saved, and pruning never deletes the newest good checkpoint. Saves are atomic (written aside, published by a rename once every rank is done; the
last ``keep_last`` are kept); loading never unpickles arbitrary objects (DCP's ``.metadata`` is
read with a restricted unpickler, tensors with ``weights_only=True``). Errors name what differs.
"""

from vemesh.resilience.checkpoint.api import acquire_lock, load, load_latest, release_lock, save
from vemesh.resilience.checkpoint.errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    DamagedCheckpointError,
    IncompatibleCheckpointError,
)
from vemesh.resilience.checkpoint.files import CheckpointInfo, checkpoint_path, list_checkpoints

__all__ = [
    "save",
    "load",
    "load_latest",
    "acquire_lock",
    "release_lock",
    "list_checkpoints",
    "checkpoint_path",
    "CheckpointInfo",
    "CheckpointError",
    "CheckpointNotFoundError",
    "DamagedCheckpointError",
    "IncompatibleCheckpointError",
    "CheckpointLockedError",
]
